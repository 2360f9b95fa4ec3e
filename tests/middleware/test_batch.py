"""Embedding micro-batching: the batcher against an in-process fake upstream, its config, and
one end-to-end run through the gateway to a real emulator with the official openai client."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest
from promptlb.middleware import Config, NodeConfig, load_config
from promptlb.middleware._asgi import Receive, RequestWatch
from promptlb.middleware._batch import (
    Batcher,
    Fetch,
    Reply,
    batch_key,
    string_inputs,
)
from promptlb.middleware._batch_io import unless_gone
from promptlb.shared import ConfigError

from tests.conftest import Serve
from tests.middleware.conftest import MakeCluster, gateway_over

PATH = "/v1/embeddings"


def vector(text: str) -> list[float]:
    return [float(len(text)), float(sum(map(ord, text)))]


class Upstream:
    """A fake node: one embedding per input, listed in reverse (the ``index`` says where each
    goes), usage one token per character; rejects a batch holding an empty string with 400."""

    def __init__(
        self, status: int = 200, gate: asyncio.Event | None = None, bad: int = 400
    ) -> None:
        self.calls: list[list[str]] = []
        self.status = status
        self.bad = bad  # the status a bad input gets (TEI: 422; a proxy's body limit: 413)
        self.gate = gate
        self.called = asyncio.Event()

    def fetch(self) -> Fetch:
        async def fetch(body: dict[str, Any]) -> Reply:
            raw = body["input"]
            inputs = [raw] if isinstance(raw, str) else list(raw)
            self.calls.append(inputs)
            self.called.set()
            if self.gate is not None:
                await self.gate.wait()
            if self.status != 200:
                return Reply(self.status, None, "node is down", "upstream_error")
            if "" in inputs:
                return Reply(self.bad, None, "empty input", "invalid_request_error", "input")
            data = [
                {"object": "embedding", "index": i, "embedding": vector(s)}
                for i, s in enumerate(inputs)
            ]
            tokens = sum(len(s) for s in inputs)
            answer = {
                "object": "list",
                "data": data[::-1],
                "model": body["model"],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
            return Reply(200, answer, headers=((b"x-promptlb-node", b"n1"),))

        return fetch


def body(value: str | list[str], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": value, **fields}


async def submit(batcher: Batcher, node: Upstream, value: str | list[str], **fields: Any) -> Reply:
    b = body(value, **fields)
    inputs = string_inputs(b)
    assert inputs is not None
    return await batcher.submit(batch_key(PATH, b), b, inputs, node.fetch())


def own(reply: Reply, value: str | list[str]) -> None:
    """The reply is the caller's own answer: its vectors, in its order, indexed from 0."""
    texts = [value] if isinstance(value, str) else value
    assert reply.status == 200, reply
    assert reply.body is not None
    assert [d["index"] for d in reply.body["data"]] == list(range(len(texts)))
    assert [d["embedding"] for d in reply.body["data"]] == [vector(t) for t in texts]
    assert reply.body["model"] == "m"
    assert reply.body["usage"]["prompt_tokens"] == sum(len(t) for t in texts)


def merged(reply: Reply) -> str:
    return dict(reply.headers)[b"x-promptlb-batch"].decode()


async def test_callers_get_their_own_vectors_in_their_order() -> None:
    node, batcher = Upstream(), Batcher(0.01, 64)
    values: list[str | list[str]] = ["alpha", ["b", "cc", "ddd"], ["ee", "f"], "gggg"]
    replies = await asyncio.gather(*(submit(batcher, node, v) for v in values))
    assert node.calls == [["alpha", "b", "cc", "ddd", "ee", "f", "gggg"]]
    for reply, value in zip(replies, values, strict=True):
        own(reply, value)
        assert merged(reply) == "4"
        assert dict(reply.headers)[b"x-promptlb-node"] == b"n1"


async def test_usage_shares_add_up_to_the_upstream_total() -> None:
    node, batcher = Upstream(), Batcher(0.01, 64)

    async def fetch(b: dict[str, Any]) -> Reply:
        reply = await node.fetch()(b)
        assert reply.body is not None
        reply.body["usage"] = {"prompt_tokens": 10, "total_tokens": 10}  # not per character
        return reply

    values = ["a", "bb", "ccc"]
    replies = await asyncio.gather(
        *(batcher.submit(batch_key(PATH, body(v)), body(v), [v], fetch) for v in values)
    )
    shares = [r.body["usage"]["prompt_tokens"] for r in replies if r.body is not None]
    assert sum(shares) == 10
    assert shares == sorted(shares)  # in proportion to what each sent


async def test_max_batch_splits_and_sends_a_full_batch_at_once() -> None:
    node, batcher = Upstream(), Batcher(5.0, 4)
    started = time.monotonic()
    first = await asyncio.gather(*(submit(batcher, node, f"t{i}") for i in range(4)))
    assert time.monotonic() - started < 2.5  # full: sent without waiting out the window
    for i, reply in enumerate(first):
        own(reply, f"t{i}")
    node.calls.clear()
    values: list[str | list[str]] = ["a", "b", ["c", "d", "e"], "f", ["g", "h", "i", "j"]]
    batcher = Batcher(0.05, 4)
    replies = await asyncio.gather(*(submit(batcher, node, v) for v in values))
    assert all(len(call) <= 4 for call in node.calls)
    assert sorted(node.calls) == sorted([["a", "b"], ["c", "d", "e", "f"], ["g", "h", "i", "j"]])
    for reply, value in zip(replies, values, strict=True):
        own(reply, value)


async def test_a_batch_is_sent_when_its_window_has_passed() -> None:
    # A window long beside the test's own step: a stall of the loop between the two submits
    # must not let it pass before the second (a 0.1 s window against a 0.03 s step did).
    node, batcher = Upstream(), Batcher(0.5, 64)
    started = time.monotonic()
    task = asyncio.ensure_future(submit(batcher, node, "early"))
    await asyncio.sleep(0.03)
    assert node.calls == []  # still waiting for company
    late = asyncio.ensure_future(submit(batcher, node, "late"))
    own(await task, "early")
    own(await late, "late")
    assert 0.45 < time.monotonic() - started < 5.0
    assert node.calls == [["early", "late"]]
    own(await submit(batcher, node, "next"), "next")  # after the send: a batch of its own
    assert node.calls[-1] == ["next"]


async def test_requests_differing_in_other_fields_are_not_merged() -> None:
    node, batcher = Upstream(), Batcher(0.02, 64)
    await asyncio.gather(
        submit(batcher, node, "a"),
        submit(batcher, node, "b", encoding_format="base64"),
        submit(batcher, node, "c", dimensions=8),
        submit(batcher, node, "d", user="u1"),
        submit(batcher, node, "e"),
    )
    assert sorted(node.calls) == [["a", "e"], ["b"], ["c"], ["d"]]
    assert batch_key(PATH, body("x")) != batch_key(PATH, body("x"), "sheddable")
    assert batch_key(PATH, body("x", model="m2")) != batch_key(PATH, body("x"))
    assert batch_key(PATH, body("x", dimensions=8)) == batch_key(PATH, body(["y"], dimensions=8))


def test_only_string_inputs_are_batchable() -> None:
    assert string_inputs(body("a")) == ["a"]
    assert string_inputs(body(["a", "b"])) == ["a", "b"]
    assert string_inputs({"model": "m", "input": [1, 2, 3]}) is None  # tokens
    assert string_inputs({"model": "m", "input": [[1, 2], [3]]}) is None
    assert string_inputs({"model": "m", "input": ["a", 1]}) is None
    assert string_inputs({"model": "m", "input": []}) is None
    assert string_inputs({"model": "m"}) is None


@pytest.mark.parametrize("status", [400, 413, 422])
async def test_a_bad_input_fails_only_its_own_caller(status: int) -> None:
    # 413 (a proxy's body limit, which the merged body may pass) and 422 (TEI's validation)
    # failed every caller of the batch, where each alone would have gone through.
    node, batcher = Upstream(bad=status), Batcher(0.01, 64)
    values: list[str | list[str]] = ["ok", ["fine", ""], ["also", "good"]]
    good, bad, also = await asyncio.gather(*(submit(batcher, node, v) for v in values))
    own(good, "ok")
    own(also, ["also", "good"])
    assert bad.status == status
    assert bad.body is None and bad.message == "empty input"
    assert (bad.kind, bad.param) == ("invalid_request_error", "input")
    assert node.calls[0] == ["ok", "fine", "", "also", "good"]
    assert sorted(node.calls[1:]) == [["also", "good"], ["fine", ""], ["ok"]]  # one by one
    assert merged(good) == "1"  # answered by its own request


async def test_an_upstream_error_reaches_every_caller_of_the_batch() -> None:
    node, batcher = Upstream(status=503), Batcher(0.01, 64)
    replies = await asyncio.gather(*(submit(batcher, node, v) for v in ["a", "b", "c"]))
    assert len(node.calls) == 1  # not retried: only a 400 can be one caller's fault
    assert {(r.status, r.message, merged(r)) for r in replies} == {(503, "node is down", "3")}


async def test_a_wrong_number_of_embeddings_is_a_502_for_every_caller() -> None:
    batcher = Batcher(0.01, 64)

    async def short(b: dict[str, Any]) -> Reply:
        data = [{"object": "embedding", "index": 0, "embedding": [0.0]}]
        return Reply(200, {"object": "list", "data": data, "model": "m"})

    async def broken(b: dict[str, Any]) -> Reply:
        raise RuntimeError("a bug")

    for fetch in (short, broken):
        replies = await asyncio.gather(
            *(batcher.submit(batch_key(PATH, body(v)), body(v), [v], fetch) for v in "ab")
        )
        assert [(r.status, r.kind) for r in replies] == [(502, "upstream_error")] * 2


async def test_a_caller_that_leaves_before_the_send_is_left_out() -> None:
    node, batcher = Upstream(), Batcher(0.05, 64)
    first = asyncio.ensure_future(submit(batcher, node, "stay"))
    gone = asyncio.ensure_future(submit(batcher, node, ["leave", "now"]))
    last = asyncio.ensure_future(submit(batcher, node, "stay too"))
    await asyncio.sleep(0.01)
    gone.cancel()
    own(await first, "stay")
    own(await last, "stay too")
    assert gone.cancelled()
    assert node.calls == [["stay", "stay too"]]
    assert merged(first.result()) == "2"


async def test_a_caller_that_leaves_after_the_send_is_discarded() -> None:
    gate = asyncio.Event()
    node, batcher = Upstream(gate=gate), Batcher(0.01, 64)
    tasks = [asyncio.ensure_future(submit(batcher, node, v)) for v in ["a", "bb", "ccc"]]
    await node.called.wait()
    tasks[1].cancel()
    await asyncio.sleep(0)
    gate.set()
    own(await tasks[0], "a")
    own(await tasks[2], "ccc")
    assert tasks[1].cancelled()
    assert node.calls == [["a", "bb", "ccc"]]


async def test_when_every_caller_leaves_the_upstream_call_is_cancelled() -> None:
    cancelled = asyncio.Event()

    async def hang(b: dict[str, Any]) -> Reply:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    batcher = Batcher(0.005, 64)
    tasks = [
        asyncio.ensure_future(batcher.submit(batch_key(PATH, body(v)), body(v), [v], hang))
        for v in "ab"
    ]
    await asyncio.sleep(0.03)
    for task in tasks:
        task.cancel()
    await asyncio.wait_for(cancelled.wait(), 1)


async def test_a_client_disconnect_takes_its_caller_out_of_the_batch() -> None:
    node, batcher = Upstream(), Batcher(0.05, 64)

    async def disconnect() -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def watched(receive: Receive, name: str) -> Reply | None:
        # The watch belongs to the task that serves the request.
        return await unless_gone(RequestWatch(receive), submit(batcher, node, name))

    gone, stay = await asyncio.gather(watched(disconnect, "gone"), watched(never, "stay"))
    assert gone is None
    assert stay is not None
    own(stay, "stay")
    assert node.calls == [["stay"]]


def test_batching_config() -> None:
    nodes = (NodeConfig(name="a", url="http://127.0.0.1:1"),)
    default = Config(nodes=nodes).batching
    assert (default.enabled, default.batch_window, default.max_batch) == (False, 0.002, 64)
    loaded = load_config(
        {
            "nodes": [{"name": "a", "url": "http://127.0.0.1:1"}],
            "batching": {"enabled": True, "batch_window": "5ms", "max_batch": 16},
        }
    ).batching
    assert (loaded.enabled, loaded.batch_window, loaded.max_batch) == (True, 0.005, 16)
    for bad, key in [
        ({"batch_window": 0}, "batching.batch_window"),
        ({"batch_window": "2s"}, "batching.batch_window"),
        ({"max_batch": 1}, "batching.max_batch"),
        ({"max_batch": 2.5}, "batching.max_batch"),
        ({"enabled": "yes"}, "batching.enabled"),
        ({"size": 3}, "batching.size"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config({"nodes": [{"name": "a", "url": "http://127.0.0.1:1"}], "batching": bad})
        assert info.value.key == key


async def test_concurrent_openai_clients_share_upstream_requests(cluster: MakeCluster) -> None:
    c = cluster(
        {"a": ("--ttft-ms", "20")},
        "[batching]\nenabled = true\nbatch_window = '50ms'\nmax_batch = 16\n",
    )
    node = c.nodes["a"].model
    texts: list[list[str]] = [[f"text {i}"] * (1 + i % 3) for i in range(20)]
    for i in range(0, 20, 4):
        texts[i] = [f"text {i}", f"other {i}"]
    direct = openai.AsyncOpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0)
    alone = [(await direct.embeddings.create(model="m", input=t)).data for t in texts]

    async def stats() -> dict[str, int]:
        async with aiohttp.ClientSession() as http, http.get(node.url + "/_emulator/stats") as r:
            result: dict[str, int] = await r.json()
            return result

    before = await stats()
    api = openai.AsyncOpenAI(base_url=c.app.url + "/v1", api_key="x", max_retries=0)
    raws = await asyncio.gather(
        *(api.embeddings.with_raw_response.create(model="m", input=t) for t in texts)
    )
    after = await stats()
    upstream = after["requests"] - before["requests"]
    assert upstream < len(texts)
    batched = 0
    for raw, t, expected in zip(raws, texts, alone, strict=True):
        answer = raw.parse()
        assert [d.index for d in answer.data] == list(range(len(t)))
        assert [d.embedding for d in answer.data] == [d.embedding for d in expected]
        assert answer.model == "m"
        assert raw.headers["x-promptlb-node"] == "a"
        batched += int(raw.headers["x-promptlb-batch"]) > 1
    assert batched > 0
    # A token array is not batched: it goes through as sent.
    tokens = await api.embeddings.with_raw_response.create(model="m", input=[1, 2, 3])
    assert "x-promptlb-batch" not in tokens.headers
    assert len(tokens.parse().data) == 1


async def test_a_batch_asks_for_an_answer_it_can_split_from_a_node_that_compresses(
    serve: Serve,
) -> None:
    """The merged request went up with the first caller's Accept-Encoding (httpx and the openai
    client send gzip): a node that compresses answered gzip, which the gateway (it does not
    decompress) could not split, and every caller got a 502."""
    from aiohttp import web

    asked: list[str | None] = []

    async def embed(request: web.Request) -> web.Response:
        asked.append(request.headers.get("Accept-Encoding"))
        body = await request.json()
        # Each text's vector says which text it was ("t2" -> [2.0]).
        data = [
            {"object": "embedding", "index": i, "embedding": [float(text[1:])]}
            for i, text in enumerate(body["input"])
        ]
        n = len(body["input"])
        usage = {"prompt_tokens": n, "total_tokens": n}
        response = web.json_response(
            {"object": "list", "data": data, "model": "m", "usage": usage},
            # A node that is another batching promptlb says its own batch; and a header its
            # Connection names is that hop's alone.
            headers={
                "x-request-id": "merged-1",
                "x-promptlb-batch": "9",
                "Connection": "keep-alive, x-hop",
                "x-hop": "1",
            },
        )
        response.enable_compression()  # gzip whenever the request accepts it
        return response

    batching = {"enabled": True, "batch_window": "50ms", "max_batch": 8}
    routes = {"/v1/embeddings": embed}
    async with gateway_over(serve, routes, batching=batching) as (_, http):
        replies = await asyncio.gather(
            *(
                http.post("/v1/embeddings", json={"model": "m", "input": [f"t{i}"]})
                for i in range(3)
            )
        )
    assert [r.status_code for r in replies] == [200] * 3
    assert [r.json()["data"] for r in replies] == [
        [{"object": "embedding", "index": 0, "embedding": [float(i)]}] for i in range(3)
    ]
    assert all(r.headers["x-promptlb-batch"] == "3" for r in replies)
    assert all(r.headers["x-request-id"] == "merged-1" for r in replies)  # the node's headers
    assert all(r.headers.get_list("x-promptlb-batch") == ["3"] for r in replies)  # ours, once
    assert all("x-hop" not in r.headers for r in replies)
    assert all("content-encoding" not in r.headers for r in replies)  # the body is written anew
    assert asked == [None]  # one merged request, asking for no encoding


@pytest.mark.parametrize(
    ("status", "body", "message", "kind"),
    [
        # TEI's shape: a string error and its type beside it.
        (
            429,
            {"error": "Model is overloaded", "error_type": "Overloaded"},
            "Model is overloaded",
            "Overloaded",
        ),
        # vLLM's older shape: the error at the top level.
        (
            400,
            {"object": "error", "message": "bad dims", "type": "BadRequestError"},
            "bad dims",
            "BadRequestError",
        ),
        # An error sent as a 200: no answer, the node's words as a bad gateway.
        (
            200,
            {"error": {"message": "CUDA out of memory", "type": "server_error"}},
            "CUDA out of memory",
            "server_error",
        ),
        # OpenAI's own, whose code (not its status) tells a quota from a rate limit.
        (
            429,
            {"error": {"message": "quota", "type": "insufficient_quota", "code": "quota_x"}},
            "quota",
            "insufficient_quota",
        ),
    ],
)
async def test_a_batched_callers_error_is_the_nodes_own(
    serve: Serve, status: int, body: dict[str, Any], message: str, kind: str
) -> None:
    # The node's Retry-After was dropped (callers retried at once) and any error not nested as
    # OpenAI's became "upstream answered 4xx"; a 200 carrying an error, a generic 502.
    from aiohttp import web

    async def embed(request: web.Request) -> web.Response:
        headers = {"Retry-After": "7", "x-ratelimit-reset-requests": "20s"}
        return web.json_response(body, status=status, headers=headers)

    batching = {"enabled": True, "batch_window": "50ms", "max_batch": 8}
    async with gateway_over(serve, {"/v1/embeddings": embed}, batching=batching) as (_, http):
        replies = await asyncio.gather(
            *(
                http.post("/v1/embeddings", json={"model": "m", "input": [f"t{i}"]})
                for i in range(2)
            )
        )
    for reply in replies:
        assert reply.status_code == (status if status != 200 else 502)
        assert reply.json()["error"]["message"] == message
        assert reply.json()["error"]["type"] == kind
        assert reply.headers["retry-after"] == "7"
        assert reply.headers["x-ratelimit-reset-requests"] == "20s"  # the node's, as unbatched
        code = reply.json()["error"]["code"]
        assert code == ("quota_x" if kind == "insufficient_quota" else reply.status_code)


async def test_callers_with_other_keys_are_never_merged(serve: Serve) -> None:
    # An Azure-style node authenticates by `api-key`: caller B's inputs travelled, and were
    # billed, under caller A's key (only Authorization, when forwarded, split batches).
    from aiohttp import web

    seen: list[tuple[str | None, list[str]]] = []

    async def embed(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.headers.get("api-key"), body["input"]))
        data = [
            {"object": "embedding", "index": i, "embedding": [0.0]}
            for i in range(len(body["input"]))
        ]
        return web.json_response({"object": "list", "data": data, "model": "m"})

    batching = {"enabled": True, "batch_window": "50ms", "max_batch": 8}
    async with gateway_over(serve, {"/v1/embeddings": embed}, batching=batching) as (_, http):
        replies = await asyncio.gather(
            *(
                http.post(
                    "/v1/embeddings", json={"model": "m", "input": [t]}, headers={"api-key": k}
                )
                for t, k in (("a1", "key-a"), ("b1", "key-b"), ("a2", "key-a"))
            )
        )
    assert [r.status_code for r in replies] == [200] * 3
    assert sorted(seen) == [("key-a", ["a1", "a2"]), ("key-b", ["b1"])]


async def test_a_caller_that_leaves_while_asked_alone_has_its_own_request_cancelled() -> None:
    # Asked again one by one after a 400, a caller that left kept its own upstream request
    # running (the node worked on an answer nobody read) until the whole batch ended.
    hold = asyncio.Event()
    cancelled: list[str] = []

    def fetch_of(name: str) -> Fetch:
        async def fetch(body: dict[str, Any]) -> Reply:
            if len(body["input"]) > 1:
                return Reply(400, None, "bad input", "invalid_request_error")
            try:
                await hold.wait()
            except asyncio.CancelledError:
                cancelled.append(name)
                raise
            return Reply(200, {"object": "list", "data": [{"index": 0, "embedding": [1.0]}]})

        return fetch

    batcher = Batcher(0.01, 64)
    calls = {}
    for name in ("a", "b"):
        b = body(name)
        calls[name] = asyncio.ensure_future(
            batcher.submit(batch_key(PATH, b), b, [name], fetch_of(name))
        )
    await asyncio.sleep(0.1)  # sent, refused whole, each asked alone: held there
    calls["a"].cancel()
    await asyncio.sleep(0.05)
    assert cancelled == ["a"]
    hold.set()
    assert (await calls["b"]).status == 200
