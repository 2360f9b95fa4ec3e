"""The balancer's header filter, as a unit: what a node is sent of the client's headers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from promptlb.middleware import Config, HealthConfig, NodeConfig
from promptlb.middleware._balancer import _NAMES_KEPT, Balancer
from promptlb.middleware._config import RetryConfig
from promptlb.middleware._refusals import NoNodeAvailable, UpstreamError
from promptlb.middleware._request import Request, RequestReader
from promptlb.shared import ConfigError

from tests.conftest import Serve
from tests.middleware.conftest import MakeSnapshot, chat_node


def test_the_filter_remembers_only_so_many_header_names_and_filters_alike_past_them() -> None:
    lb = Balancer(Config(nodes=(NodeConfig(name="a", url="http://127.0.0.1:1"),)))
    node = lb.table.nodes["a"]
    made_up = [(f"x-made-up-{i}".encode(), b"v") for i in range(3 * _NAMES_KEPT)]
    client = [
        (b"content-type", b"application/json"),
        (b"Cookie", b"session=secret"),
        (b"x-promptlb-priority-token", b"secret"),
        (b"connection", b"keep-alive, X-Hop"),
        (b"x-hop", b"1"),
        (b"expect", b"100-continue"),  # answered by the gateway's server, which read the body
        (b"x-title", "café".encode()),  # written as UTF-8 by aiohttp: it must read so too
    ]
    for _ in range(2):  # the second time from what it remembered
        sent = dict(lb.forward_headers(node, made_up + client))
        assert len(lb._names) <= _NAMES_KEPT
        assert b"content-type" in lb._names  # made-up names did not keep it out for good
        assert sent["content-type"] == "application/json"
        assert sent[f"x-made-up-{3 * _NAMES_KEPT - 1}"] == "v"
        assert sent["x-title"] == "café"
        dropped = {"cookie", "x-promptlb-priority-token", "connection", "x-hop", "expect"}
        assert not dropped & set(sent)
    # Unlabelled, the body went as aiohttp's application/octet-stream (FastAPI answers 422).
    assert dict(lb.forward_headers(node, [(b"x-a", b"1")]))["content-type"] == "application/json"
    labelled = [(b"Content-Type", b"application/json; charset=utf-8")]
    assert lb.forward_headers(node, labelled) == [("content-type", labelled[0][1].decode())]


async def cancelled_while_waiting(lb: Balancer, request: Request) -> None:
    """A try on a node that does not answer, cancelled from outside: it raises the cancel."""

    async def enter() -> None:
        async with lb.open(request):
            pass

    outside = asyncio.create_task(enter())
    # Cancelled as soon as the try is on its node, not after a fixed sleep: a stall of the
    # loop past the try's own 0.2 s would have made its timeout, not the cancel, end it.
    views = [node.view for node in lb.table.nodes.values()]
    for _ in range(400):
        if any(view.in_flight for view in views):
            break
        await asyncio.sleep(0.005)
    outside.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outside


async def test_a_try_past_its_time_is_a_timeout_and_a_cancel_from_outside_stays_a_cancel(
    serve: Serve,
) -> None:
    hold = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await hold.wait()  # never set: the node answers nothing
        return web.Response()

    async with serve(chat_node(hang)) as url:
        config = Config(
            nodes=(NodeConfig(name="a", url=url, models=("m",)),),
            retry=RetryConfig(per_try_timeout=0.2, total_timeout=5.0),
        )
        lb = Balancer(config)
        reader = RequestReader(config, lb.admission)
        request = reader.build("/v1/chat/completions", {"model": "m", "messages": []})
        try:
            # The try's own timer: a 504, the task not left cancelled.
            with pytest.raises(UpstreamError) as raised:
                async with lb.open(request):
                    pass
            assert raised.value.status == 504
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0
            assert lb.table.nodes["a"].view.in_flight == 0

            # Cancelled from outside before its time (a client gone, a hedge lost): a cancel.
            await cancelled_while_waiting(lb, request)
            assert lb.table.nodes["a"].view.in_flight == 0
        finally:
            hold.set()  # the node's handlers end, so that the server stops at once
            await lb.stop()


async def test_every_try_that_ends_is_told_to_the_replicas_that_share(serve: Serve) -> None:
    """Each pick is load on its node for the other replicas until its try ends: answered,
    retried after a 503, timed out or cancelled, the end goes out as the pick did."""
    hold = asyncio.Event()
    mode = {"a": "503", "b": "ok"}

    def answering(name: str) -> web.Application:
        async def chat(request: web.Request) -> web.Response:
            if mode[name] == "hang":
                await hold.wait()
            if mode[name] == "503":
                return web.Response(status=503)
            return web.json_response({"choices": []})

        return chat_node(chat)

    async with serve(answering("a")) as a_url, serve(answering("b")) as b_url:
        config = Config(
            nodes=(
                NodeConfig(name="a", url=a_url, models=("m",)),
                NodeConfig(name="b", url=b_url, models=("m",)),
            ),
            retry=RetryConfig(per_try_timeout=0.2, total_timeout=5.0, attempts=2),
        )
        lb = Balancer(config)
        index = lb.strategy.prefix_index
        assert index is not None and lb.index is index
        index.share()
        reader = RequestReader(config, lb.admission)
        request = reader.build("/v1/chat/completions", {"model": "m", "messages": []})

        def told() -> tuple[list[str], dict[str, int]]:
            return [name for name, _ in index.sent()], dict(index.finishes())

        try:
            for _ in range(6):  # the 503 on a, then b answers; or b at once
                async with lb.open(request):
                    pass
            sent, ended = told()
            assert len(sent) > 6 and ended == {n: sent.count(n) for n in set(sent)}
            mode["a"] = mode["b"] = "hang"
            with pytest.raises(UpstreamError):  # both tries time out
                async with lb.open(request):
                    pass
            sent, ended = told()  # (a is ejected by now, for its 503s: b alone is tried)
            assert sent and ended == {n: sent.count(n) for n in set(sent)}
            await cancelled_while_waiting(lb, request)
            sent, ended = told()
            assert len(sent) == 1 and ended == {sent[0]: 1}
        finally:
            hold.set()
            await lb.stop()


async def test_no_node_available_is_counted_by_model_only_for_models_a_node_names() -> None:
    """A node that names no model takes any: with it down, every string a client sends as its
    model reaches the 503, and a label per string would grow the metrics without bound."""
    config = Config(
        nodes=(
            NodeConfig(name="any", url="http://127.0.0.1:1"),
            NodeConfig(name="named", url="http://127.0.0.1:1", models=("m",)),
        )
    )
    lb = Balancer(config)
    for node in lb.table.nodes.values():  # both down
        lb.table.record_health(node, False, "down", 0.0)
    reader = RequestReader(config, lb.admission)
    try:
        for model in ("m", "made-up-1", "made-up-2", "made-up-3"):
            request = reader.build("/v1/chat/completions", {"model": model, "messages": []})
            with pytest.raises(NoNodeAvailable):
                async with lb.open(request):
                    pass
        metrics = lb.metrics.render().decode()
    finally:
        await lb.stop()
    counted = [line for line in metrics.splitlines() if line.startswith("promptlb_no_node")]
    assert 'promptlb_no_node_available_total{model="m"} 1.0' in counted
    assert 'promptlb_no_node_available_total{model="other"} 3.0' in counted
    assert not any("made-up" in line for line in counted)


def test_a_nodes_key_is_the_one_its_current_config_says_whichever_balancer_sends() -> None:
    """During a reload, requests still on the old balancer reach nodes the new config added
    or re-keyed: the key came from the old balancer's config, so they went without it (401)."""
    old = Balancer(Config(nodes=(NodeConfig(name="a", url="http://127.0.0.1:1", api_key="k1"),)))
    rotated = NodeConfig(name="a", url="http://127.0.0.1:1", api_key="k2")
    added = NodeConfig(name="b", url="http://127.0.0.1:2", api_key="kb")
    new = Balancer(Config(nodes=(rotated, added)), previous=old)
    new.table.reconfigure(new.config)  # what succeed() does, before the switch
    client = [(b"authorization", b"Bearer the-callers")]
    for lb in (old, new):
        sent = {n: dict(lb.forward_headers(lb.table.nodes[n], client)) for n in ("a", "b")}
        assert sent["a"]["authorization"] == "Bearer k2"
        assert sent["b"]["authorization"] == "Bearer kb"


async def test_a_start_that_fails_leaves_nothing_started_and_nothing_open(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The token file went missing after the config loaded: each request's start raised after
    # making a client session, which was left open (or, before, kept: the balancer then
    # counted as started with no gossip or health at all).
    token = tmp_path / "token"
    token.write_text("a-sidecar-token")
    config = Config(
        nodes=(NodeConfig(name="a", url="http://127.0.0.1:9"),), sidecar_token_file=str(token)
    )
    token.unlink()
    lb = Balancer(config)
    for _ in range(2):
        with pytest.raises(ConfigError, match="sidecar_token_file"):
            await lb.start()
        assert not lb.started and lb._evidence is None
    gc.collect()
    assert not [r for r in caplog.records if "Unclosed client session" in r.getMessage()]


async def test_a_stop_during_a_start_waits_for_it_and_leaves_nothing_running(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    # The sidecar answers the first gossip round slowly: a stop that came meanwhile found no
    # session yet, and the start then went on to open one and start loops nobody stopped.
    asked = asyncio.Event()

    async def snapshot(request: web.Request) -> web.Response:
        asked.set()
        await asyncio.sleep(0.3)
        return web.Response(status=503)

    app = web.Application()
    app.router.add_get("/snapshot", snapshot)
    async with serve(app) as url:
        config = Config(nodes=(NodeConfig(name="a", url="http://127.0.0.1:9", sidecar=url),))
        lb = Balancer(config)
        starting = asyncio.create_task(lb.start())
        await asyncio.wait_for(asked.wait(), 5)
        await lb.stop()
        await starting
        assert not lb.started and lb._evidence is None
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("promptlb-")]
    gc.collect()
    assert not [r for r in caplog.records if "Unclosed client session" in r.getMessage()]


@pytest.fixture
def unanswered_port() -> Iterator[int]:
    """A port whose connects are never answered: its one-place backlog is full."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    waiting = []
    try:
        for _ in range(3):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            waiting.append(sock)
        yield port
    finally:
        for sock in (*waiting, listener):
            sock.close()


async def test_a_connect_timeout_is_the_nodes_and_retried_whatever_max_tokens(
    serve: Serve, unanswered_port: int
) -> None:
    # aiohttp's connect timeout is a TimeoutError too: taken for the try's own timer, a long
    # non-streamed max_tokens read as "takes longer than a try", answered 504 with no retry
    # and nothing counted against the node that never took the connection.
    port = unanswered_port

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    async with serve(chat_node(chat)) as url:
        config = Config(
            nodes=(
                NodeConfig(name="dead", url=f"http://127.0.0.1:{port}", models=("m",)),
                NodeConfig(name="ok", url=url, models=("m",)),
            ),
            health=HealthConfig(enabled=False),
            strategy="round_robin",
            retry=RetryConfig(attempts=2, connect_timeout=0.2, per_try_timeout=30.0),
        )
        lb = Balancer(config)
        reader = RequestReader(config, lb.admission)
        body = {"model": "m", "messages": [], "max_tokens": 2_000}  # 100 s at 20 tokens/s
        try:
            for _ in range(4):  # round robin: the dead node is tried first at least once
                request = reader.build("/v1/chat/completions", body)
                async with lb.open(request) as up:
                    assert up.node.name == "ok" and up.response.status == 200
            assert lb.table.nodes["dead"].view.error_rate > 0  # charged to the node
        finally:
            await lb.stop()


@pytest.mark.parametrize(("seen_after", "charged"), [(1.3, True), (0.0, False)])
async def test_a_long_answer_a_node_is_not_generating_is_the_nodes_timeout(
    serve: Serve, snap: MakeSnapshot, seen_after: float, charged: bool
) -> None:
    # A node that takes requests and generates nothing (health passing), asked a long
    # non-streamed answer: "takes longer than a try" excused it every time, no retry, no
    # failure, never ejected, while its snapshots showed its engine running nothing. A
    # snapshot that came just after the try began may have been read before it: no proof.
    lb: Balancer

    async def hung(request: web.Request) -> web.Response:
        await asyncio.sleep(seen_after)  # then a snapshot: its engine runs nothing
        node = lb.table.nodes["hung"]
        lb.table.record_snapshot(node, snap("hung", running=0), time.monotonic())
        await asyncio.sleep(4.0 - seen_after)  # past the try's 3 s
        return web.json_response({"choices": []})

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    async with serve(chat_node(hung)) as stuck, serve(chat_node(chat)) as url:
        config = Config(
            nodes=(
                NodeConfig(name="hung", url=stuck, models=("m",)),
                NodeConfig(name="ok", url=url, models=("m",)),
            ),
            health=HealthConfig(enabled=False),
            strategy="round_robin",
            # 3 s: the snapshot at 1.3 s lands in the try even if the handler starts late.
            retry=RetryConfig(attempts=2, per_try_timeout=3.0),
        )
        lb = Balancer(config)
        reader = RequestReader(config, lb.admission)
        body = {"model": "m", "messages": [], "max_tokens": 2_000}  # 100 s at 20 tokens/s
        strategy: Any = lb.strategy
        strategy._next = {"m": 0}  # round robin: the hung node first
        try:
            request = reader.build("/v1/chat/completions", body)
            if charged:
                async with lb.open(request) as up:
                    assert up.node.name == "ok" and up.response.status == 200
            else:
                with pytest.raises(UpstreamError) as refused:
                    async with lb.open(request):
                        pass
                assert refused.value.status == 504  # the request's size, not the node
            node = lb.table.nodes["hung"]
            assert (node.failures, node.request_faults) == ((1, 0) if charged else (0, 1))
        finally:
            await lb.stop()


async def test_a_reloaded_connect_timeout_is_the_one_tries_use(unanswered_port: int) -> None:
    # The session, with the first config's connect timeout, passes to the new balancer: the
    # new timeout was logged as changed and never used.
    port = unanswered_port

    def config(connect: float) -> Config:
        return Config(
            nodes=(NodeConfig(name="a", url=f"http://127.0.0.1:{port}", models=("m",)),),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(attempts=1, connect_timeout=connect),
        )

    old = Balancer(config(0.2))
    await old.start()
    lb = Balancer(config(1.2), previous=old)
    try:
        await lb.succeed(old)
        request = RequestReader(lb.config, lb.admission).build(
            "/v1/chat/completions", {"model": "m", "messages": []}
        )
        started = time.monotonic()
        with pytest.raises(UpstreamError):
            async with lb.open(request):
                pass
        assert time.monotonic() - started >= 1.0
    finally:
        await lb.stop()
