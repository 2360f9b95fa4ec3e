"""What the proxy sends upstream and hands back, against a capturing upstream in process."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from promptlb.middleware import PromptLBMiddleware
from promptlb.middleware import _proxy as proxy

from tests.conftest import Launcher, Serve
from tests.middleware.conftest import MakeSnapshot, chat_node, gateway_over


@pytest.fixture
async def upstream(serve: Serve) -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    seen: list[dict[str, str]] = []

    async def handler(request: web.Request) -> web.Response:
        if request.path == "/v1/chat/completions":
            seen.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response(
            {"ok": True, "choices": []}, headers={"Connection": "keep-alive", "X-Upstream": "yes"}
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    async with serve(app) as url:
        yield url, seen


async def post(app: PromptLBMiddleware, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as http:
        return await http.post(
            "/v1/chat/completions?x=1", headers=headers, json={"model": "m", "messages": []}
        )


async def noop(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the app is not reached for balanced routes")


async def test_client_authorization_is_dropped_and_the_node_key_injected(
    upstream: tuple[str, list[dict[str, str]]],
) -> None:
    url, seen = upstream
    app = PromptLBMiddleware(
        noop, config={"nodes": [{"name": "a", "url": url, "models": ["m"], "api_key": "sk-node-a"}]}
    )
    response = await post(
        app,
        {
            "Authorization": "Bearer client-secret",
            "X-Trace": "t1",
            "X-Hop": "h",
            "Connection": "keep-alive, X-Hop",
            "TE": "trailers",
        },
    )
    await app.balancer.stop()
    assert response.status_code == 200
    assert response.headers["x-upstream"] == "yes"
    assert response.headers["x-promptlb-node"] == "a"
    assert "keep-alive" not in response.headers.get("connection", "")  # hop-by-hop stripped
    (headers,) = seen
    assert headers["authorization"] == "Bearer sk-node-a"
    assert "te" not in headers
    assert "x-hop" not in headers  # named by Connection: hop-by-hop as well
    assert headers["x-trace"] == "t1"


async def test_client_authorization_is_forwarded_only_when_configured(
    upstream: tuple[str, list[dict[str, str]]],
) -> None:
    url, seen = upstream
    app = PromptLBMiddleware(
        noop,
        config={
            "forward_authorization": True,
            "nodes": [{"name": "a", "url": url, "models": ["m"]}],
        },
    )
    await post(app, {"Authorization": "Bearer client-secret"})
    plain = PromptLBMiddleware(noop, config={"nodes": [{"name": "a", "url": url, "models": ["m"]}]})
    await post(plain, {"Authorization": "Bearer client-secret"})
    await app.balancer.stop()
    await plain.balancer.stop()
    assert seen[0]["authorization"] == "Bearer client-secret"
    assert "authorization" not in seen[1]


async def test_the_in_app_client_streams_and_embeds(launch: Launcher) -> None:
    model = launch("emulator", "--model", "m", "--ttft-ms", "5", "--tokens-per-s", "500")
    app = PromptLBMiddleware(
        noop, config={"nodes": [{"name": "a", "url": model.url, "models": ["m"]}]}
    )
    lb, client = app.balancer, app.client
    try:
        chunks = [
            c
            async for c in client.chat_stream(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=6
            )
        ]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == "the quick brown fox jumps over "
        vectors = await client.embeddings(model="m", input=["a", "b"])
        assert len(vectors["data"]) == 2
        assert lb.table.nodes["a"].view.in_flight == 0
    finally:
        await lb.stop()


async def test_the_gateway_serves_the_middleware(launch: Launcher, tmp_path: Path) -> None:
    model = launch("emulator", "--model", "m", "--ttft-ms", "5")
    config = tmp_path / "promptlb.toml"
    config.write_text(f"[[nodes]]\nname = 'a'\nurl = '{model.url}'\nmodels = ['m']\n")
    gateway = launch("middleware", "--config", str(config))
    async with aiohttp.ClientSession() as http:
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        async with http.post(gateway.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            # one Date and one Server: the gateway's own, not the node's beside them
            assert len(response.headers.getall("date")) == 1
            assert len(response.headers.getall("server")) == 1
            assert response.headers["x-promptlb-node"] == "a"
            assert json.loads(await response.read())["choices"]
        async with http.get(gateway.url + "/elsewhere") as response:
            assert response.status == 404


def test_the_gateway_rejects_a_bad_config_with_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("strategy = 'fastest'\n[[nodes]]\nname = 'a'\nurl = 'http://x:1'\n")
    done = subprocess.run(
        [sys.executable, "-m", "promptlb.middleware", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "strategy: got 'fastest'" in done.stderr


def test_the_retry_budget_is_a_share_of_active_requests_with_a_floor() -> None:
    from promptlb.middleware._rules import RetryBudget

    budget = RetryBudget(percent=20.0, min_concurrent=3)
    budget.active = 5
    budget.retrying = 2
    assert budget.allow()  # under the floor of 3
    budget.retrying = 3
    assert not budget.allow()  # 20% of 5 is 1, the floor is 3
    budget.active = 100
    assert budget.allow()  # 20% of 100 is 20
    budget.retrying = 20
    assert not budget.allow()


def test_the_gateway_parses_http_with_httptools() -> None:
    from promptlb.middleware._gateway import server_config

    config = server_config(noop, "127.0.0.1", 0, "warning")
    config.load()  # resolves the protocol class, failing if httptools is not installed
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert issubclass(config.http_protocol_class, HttpToolsProtocol)  # guarded: header timeout


def test_forwarded_headers_are_believed_only_from_the_configured_proxies() -> None:
    from promptlb.middleware._gateway import server_config

    assert server_config(noop, "127.0.0.1", 0, "warning").proxy_headers is False
    behind = server_config(noop, "127.0.0.1", 0, "warning", forwarded_allow_ips="10.0.0.1")
    assert behind.proxy_headers is True
    assert behind.forwarded_allow_ips == "10.0.0.1"


def test_a_started_server_freezes_its_startup_heap_and_collects_young_objects_less_often() -> None:
    import gc

    from promptlb.middleware._gateway import _YOUNG_GC_THRESHOLD, _settle_heap

    before = gc.get_threshold()
    try:
        _settle_heap()
        assert gc.get_freeze_count() > 0
        # The young threshold rises past a busy server's live set; the older ones stay.
        assert gc.get_threshold() == (_YOUNG_GC_THRESHOLD, *before[1:])
        assert before[0] < _YOUNG_GC_THRESHOLD
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


@pytest.fixture
async def busy(serve: Serve) -> AsyncIterator[str]:
    """A node that answers every request 429, with its own error and Retry-After."""

    async def handler(request: web.Request) -> web.Response:
        if request.path != "/v1/chat/completions":
            return web.json_response({"ok": True})  # its health checks pass
        error = {"error": {"message": "node busy", "type": "rate_limit"}}
        return web.json_response(error, status=429, headers={"Retry-After": "7"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    async with serve(app) as url:
        yield url


async def test_a_final_answer_is_passed_on_when_no_retry_can_be_made(busy: str) -> None:
    # The budget allows no retry: the node's own 429 is the answer, not a 502 for a response
    # let go of before the retry turned out impossible.
    nodes = [{"name": n, "url": busy, "models": ["m"]} for n in ("a", "b")]
    app = PromptLBMiddleware(
        noop,
        config={"retry": {"budget_percent": 0, "min_concurrent": 0}, "nodes": nodes},
    )
    try:
        response = await post(app, {})
        assert response.status_code == 429
        assert response.headers["retry-after"] == "7"
        assert response.json()["error"]["message"] == "node busy"
        assert response.headers["x-promptlb-attempts"] == "1"
        metrics = app.balancer.metrics.render().decode()
        assert "promptlb_retry_budget_exhausted_total 1.0" in metrics
    finally:
        await app.balancer.stop()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def node_answering(
    serve: Serve, chat: Handler, **config: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """The middleware over one in-process node whose chat completions ``chat`` answers, with
    ``config``'s keys beside the node; yields an httpx client on the middleware."""
    async with serve(chat_node(chat)) as url:
        app = PromptLBMiddleware(
            noop, config={**config, "nodes": [{"name": "a", "url": url, "models": ["m"]}]}
        )
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://test"
            ) as http:
                yield http
        finally:
            await app.balancer.stop()


CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
FRESH = {"cache": {"serve_fresh": True}}


async def test_a_cached_answer_is_shared_only_by_callers_of_the_same_forwarded_key(
    serve: Serve,
) -> None:
    """With the caller's key forwarded, the node decides per key: an answer it gave one key
    must not reach a caller whose key it refuses, nor one with none."""

    async def chat(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer good":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"id": "x", "choices": [{"index": 0, "text": "secret"}]})

    async with node_answering(serve, chat, forward_authorization=True, **FRESH) as http:

        async def ask(key: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = await http.post("/v1/chat/completions", json=CHAT_BODY, headers=headers)
            await asyncio.sleep(0.05)  # the cache is written in the background
            return response

        assert (await ask("good")).status_code == 200
        again = await ask("good")
        assert again.status_code == 200 and again.headers["x-promptlb-cache"] == "hit"
        for other in ("bad", None):
            refused = await ask(other)
            assert refused.status_code == 401, other
            assert "x-promptlb-cache" not in refused.headers


@pytest.mark.parametrize(
    ("header", "config"),
    [
        ("api-key", {}),
        # An API gateway's subscription key, named in the config.
        ("Ocp-Apim-Subscription-Key", {"caller_headers": ["Ocp-Apim-Subscription-Key"]}),
    ],
)
async def test_a_cached_answer_is_shared_only_by_callers_of_the_same_api_key(
    serve: Serve, header: str, config: dict[str, Any]
) -> None:
    """An Azure-style node checks ``api-key``, which reaches it whatever forward_authorization
    says: the cache keyed no such header, so a caller with a wrong key or none was served
    another tenant's answer as a hit, and no node ever saw its key."""

    async def chat(request: web.Request) -> web.Response:
        if request.headers.get(header) != "good":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"id": "x", "choices": [{"index": 0, "text": "secret"}]})

    async with node_answering(serve, chat, **FRESH, **config) as http:

        async def ask(key: str | None) -> httpx.Response:
            headers = {header: key} if key else {}
            response = await http.post("/v1/chat/completions", json=CHAT_BODY, headers=headers)
            await asyncio.sleep(0.05)  # the cache is written in the background
            return response

        assert (await ask("good")).status_code == 200
        assert (await ask("good")).headers["x-promptlb-cache"] == "hit"
        for other in ("bad", None):
            refused = await ask(other)
            assert refused.status_code == 401, other
            assert "x-promptlb-cache" not in refused.headers


async def test_a_stored_answer_keeps_its_content_type_and_an_error_in_a_200_is_not_stored(
    serve: Serve,
) -> None:
    """Every entry was replayed as application/json (a text answer too), and a node's 200
    whose body is an error was stored and served again as an answer."""

    async def text(request: web.Request) -> web.Response:
        return web.Response(text="plain words", content_type="text/plain")

    async def error(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "overloaded", "type": "engine"}})

    routes = {"/v1/completions": text, "/v1/chat/completions": error}
    async with gateway_over(serve, routes, **FRESH) as (_, http):
        body = {"model": "m", "prompt": "p", "temperature": 0}
        assert (await http.post("/v1/completions", json=body)).text == "plain words"
        await asyncio.sleep(0.05)  # the cache is written in the background
        again = await http.post("/v1/completions", json=body)
        assert again.headers["x-promptlb-cache"] == "hit" and again.text == "plain words"
        assert again.headers["content-type"].startswith("text/plain")
        for _ in range(2):
            got = await http.post("/v1/chat/completions", json=CHAT_BODY)
            assert got.json()["error"]["message"] == "overloaded"
            assert "x-promptlb-cache" not in got.headers
            await asyncio.sleep(0.05)


async def test_ttft_is_a_streams_first_byte_and_a_timed_out_try_is_in_the_histograms(
    serve: Serve,
) -> None:
    """A whole answer's first byte comes with its last: TTFT read the generation's time (its
    P99 alert fired on non-streamed traffic). And a try given up at its deadline was in
    neither histogram: the tries that break an SLO were the ones they never saw."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await asyncio.sleep(2.0 if body.get("max_tokens") == 99 else 0.05)
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "ok"}}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    retry = {"retry": {"attempts": 1, "per_try_timeout": "0.3s"}}
    async with gateway_over(serve, {"/v1/chat/completions": chat}, **retry) as (app, http):
        count = app.balancer.metrics.registry.get_sample_value

        def seen(family: str) -> float:
            return count(f"promptlb_{family}_seconds_count", {"node": "n"}) or 0.0

        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        assert (seen("latency"), seen("ttft")) == (1, 0)  # a whole answer: no first token
        streamed = {**body, "stream": True}
        assert (await http.post("/v1/chat/completions", json=streamed)).status_code == 200
        assert (seen("latency"), seen("ttft")) == (2, 1)
        late = {**streamed, "max_tokens": 99}
        assert (await http.post("/v1/chat/completions", json=late)).status_code == 504
        assert (seen("latency"), seen("ttft")) == (3, 2)  # at the time it was given up


async def test_ttft_counts_answers_first_tokens_not_error_bodies_and_not_less_for_a_break(
    serve: Serve,
) -> None:
    """A stream refused with a 400 at once was the fastest "first token" there was (in the
    histogram and in the node's TTFT the strategies read), and a stream broken after its
    first token was left out of the histogram."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("max_tokens") == 0:
            return web.json_response({"error": {"message": "max_tokens"}}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.05)
        await response.write(b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n')
        assert request.transport is not None
        request.transport.close()  # broken off after the first token
        return response

    retry = {"retry": {"attempts": 1}}
    async with gateway_over(serve, {"/v1/chat/completions": chat}, **retry) as (app, http):
        count = app.balancer.metrics.registry.get_sample_value
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
        refused = await http.post("/v1/chat/completions", json={**body, "max_tokens": 0})
        assert refused.status_code == 400
        assert (count("promptlb_ttft_seconds_count", {"node": "n"}) or 0.0) == 0
        assert app.balancer.table.nodes["n"].view.ewma_ttft_s is None
        with contextlib.suppress(httpx.HTTPError):
            await http.post("/v1/chat/completions", json=body)
        await asyncio.sleep(0.1)
        assert count("promptlb_ttft_seconds_count", {"node": "n"}) == 1
        assert (count("promptlb_ttft_seconds_sum", {"node": "n"}) or 0.0) >= 0.05


@pytest.mark.parametrize("reading", ["none", "idle", "idle, read before the try"])
async def test_a_stream_cut_at_its_deadline_is_excused_by_its_size_unless_nothing_ran(
    serve: Serve, snap: MakeSnapshot, reading: str
) -> None:
    """A long stream cut at its total deadline is the request's size, not the node's, and its
    first token is one all the same (it was left out of the TTFT histogram); unless an engine
    reading taken during it showed the node running nothing (it was excused anyway). A
    reading the sidecar kept from before the try (its age says so) proves nothing."""
    gateway: PromptLBMiddleware

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n')
        await asyncio.sleep(1.3)
        if reading != "none":
            age_ms = 2_000 if reading == "idle, read before the try" else 100
            table = gateway.balancer.table
            idle = snap("n", running=0, age_ms=age_ms)
            table.record_snapshot(table.nodes["n"], idle, time.monotonic())
        await asyncio.sleep(2.5)  # past the 2.5 s deadline
        return response

    # 2.5 s: the snapshot at 1.3 s lands in the stream even if the handler starts late.
    retry = {"retry": {"attempts": 1, "total_timeout": "2.5s"}}
    async with gateway_over(serve, {"/v1/chat/completions": chat}, **retry) as (app, http):
        gateway = app
        count = app.balancer.metrics.registry.get_sample_value
        body = {"model": "m", "messages": [], "stream": True, "max_tokens": 2000}
        with contextlib.suppress(httpx.HTTPError):
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    pass
        await asyncio.sleep(0.1)
        node = app.balancer.table.nodes["n"]
        charged = reading == "idle"
        assert (node.failures, node.request_faults) == ((1, 0) if charged else (0, 1))
        assert count("promptlb_ttft_seconds_count", {"node": "n"}) == 1


async def test_the_query_string_is_part_of_the_cache_key(serve: Serve) -> None:
    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"index": 0, "text": request.query_string}]})

    async with node_answering(serve, chat, **FRESH) as http:
        answers = []
        for query in ("a=1", "a=2", "a=1"):
            response = await http.post(f"/v1/chat/completions?{query}", json=CHAT_BODY)
            answers.append(
                (response.json()["choices"][0]["text"], "x-promptlb-cache" in response.headers)
            )
            await asyncio.sleep(0.05)
    assert answers == [("a=1", False), ("a=2", False), ("a=1", True)]


async def test_header_names_are_passed_on_lower_case(serve: Serve) -> None:
    """ASGI header names are lower case: a middleware outside (GZip's) looks up b"content-length"
    and would miss the node's "Content-Length"."""

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"choices": []}, headers={"X-Node-Header": "yes"})

    async with node_answering(serve, chat) as http:
        response = await http.post("/v1/chat/completions", json=CHAT_BODY)
    names = [name for name, _ in response.headers.raw]
    assert b"x-node-header" in names and b"content-length" in names
    assert all(name == name.lower() for name in names), names


async def test_response_headers_the_nodes_connection_header_names_are_not_passed_on(
    serve: Serve,
) -> None:
    """RFC 9110 7.6.1: what a node's Connection header names is for the hop to the gateway
    alone, as the client's is for the hop to the gateway."""

    async def chat(request: web.Request) -> web.Response:
        headers = {"Connection": "keep-alive, X-Node-Hop", "X-Node-Hop": "1", "X-Kept": "yes"}
        return web.json_response({"choices": []}, headers=headers)

    async with node_answering(serve, chat) as http:
        response = await http.post("/v1/chat/completions", json=CHAT_BODY)
    assert response.status_code == 200
    assert "x-node-hop" not in response.headers
    assert response.headers["x-kept"] == "yes"

    async def odd(request: web.Request) -> web.Response:
        # A token latin-1 cannot encode: read as text, it raised before the answer started.
        return web.json_response({"choices": []}, headers={"Connection": "keep-alive, x-€"})

    async with node_answering(serve, odd) as http:
        assert (await http.post("/v1/chat/completions", json=CHAT_BODY)).status_code == 200


async def test_a_compressed_answer_is_passed_on_but_not_cached(serve: Serve) -> None:
    plain = json.dumps({"choices": [{"index": 0, "text": "hello"}]}).encode()

    async def chat(request: web.Request) -> web.Response:
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return web.Response(
                body=gzip.compress(plain),
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            )
        return web.Response(body=plain, content_type="application/json")

    async with node_answering(serve, chat, **FRESH) as http:
        zipped = await http.post(
            "/v1/chat/completions", json=CHAT_BODY, headers={"Accept-Encoding": "gzip"}
        )
        assert zipped.headers["content-encoding"] == "gzip" and zipped.content == plain
        await asyncio.sleep(0.05)
        bare = await http.post(
            "/v1/chat/completions", json=CHAT_BODY, headers={"Accept-Encoding": "identity"}
        )
    assert "x-promptlb-cache" not in bare.headers  # the gzip bytes were not kept
    assert "content-encoding" not in bare.headers and bare.content == plain


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=40) | st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r", b"\n"])))
def test_holding_back_an_events_start_loses_and_reorders_nothing(chunks: list[bytes]) -> None:
    out, held = b"", b""
    for chunk in chunks:
        sent, held = proxy._whole_events(chunk, held)
        # Whole events only, however their lines end (CR, LF or CRLF, as the spec allows).
        assert not sent or sent.endswith((b"\n\n", b"\r\r", b"\n\r\n", b"\r\n\r"))
        out += sent
    assert out + held == b"".join(chunks)
    assert not held.endswith((b"\n\n", b"\r\r"))  # held back: never a whole event's end


async def test_a_stream_cut_inside_an_event_ends_with_the_error_event_alone(
    serve: Serve,
) -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\n')
        await asyncio.sleep(0.05)
        await response.write(b'data: {"choices": [{"delta": {"content": "he')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()  # the node dies inside an event
        return response

    async with node_answering(serve, chat) as http:
        response = await http.post("/v1/chat/completions", json={**CHAT_BODY, "stream": True})
    events = response.content.split(b"\n\n")
    assert events[0] == b'data: {"choices": []}'
    # The cut event is held back, never sent: after half of it (ended by a blank line) the
    # openai client failed on its JSON instead of raising the error event that followed.
    assert b'"he' not in response.content
    error = json.loads(events[1].removeprefix(b"data: "))
    assert error["error"]["type"] == "upstream_error"


async def test_a_body_cut_short_is_not_ended_as_whole_and_counts_against_the_node(
    launch: Launcher, serve: Serve, tmp_path: Path
) -> None:
    """A non-stream answer the node cut short: the client must not take it for a whole (short)
    body, and the node's failure is recorded as its own, not as a caller who left."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        if request.query_string == "sized":
            response.content_length = 1000
        await response.prepare(request)
        await response.write(b'{"choices": [{"index": 0, "text": "')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return response

    async with serve(chat_node(chat)) as url:
        config = tmp_path / "promptlb.toml"
        config.write_text(
            "admin_local_only = true\n[health]\ninterval = '100ms'\n"
            f"[[nodes]]\nname = 'a'\nurl = '{url}'\nmodels = ['m']\n"
        )
        # Its first health check finds this loop blocked in launch(): wait for the next ones.
        gateway = launch("middleware", "--config", str(config))
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                async with http.get(gateway.url + "/_promptlb/status") as response:
                    if (await response.json())["nodes"][0]["state"] == "ready":
                        break
                await asyncio.sleep(0.05)
            for query in ("sized", "chunked"):
                async with http.post(
                    f"{gateway.url}/v1/chat/completions?{query}", json=CHAT_BODY
                ) as response:
                    assert response.status == 200, await response.text()
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await response.read()
            async with http.get(gateway.url + "/_promptlb/metrics") as response:
                metrics = await response.text()
    assert 'outcome="broken"' in metrics and 'outcome="aborted"' not in metrics


async def test_a_nodes_own_promptlb_headers_are_replaced_by_this_gateways(serve: Serve) -> None:
    """A node that is itself a promptlb gateway answers with its x-promptlb-* headers: passed
    on, every one would come twice with two values."""

    async def chat(request: web.Request) -> web.Response:
        inner = {"x-promptlb-node": "inner-node", "x-promptlb-attempts": "2", "x-other": "kept"}
        return web.json_response({"choices": []}, headers=inner)

    async with node_answering(serve, chat) as http:
        response = await http.post("/v1/chat/completions", json=CHAT_BODY)
    assert response.headers.get_list("x-promptlb-node") == ["a"]
    assert response.headers.get_list("x-promptlb-attempts") == ["1"]
    assert response.headers["x-other"] == "kept"


async def test_under_a_mount_prefix_the_routes_match_and_the_node_sees_its_own_path(
    upstream: tuple[str, list[dict[str, str]]],
) -> None:
    # ASGI's path carries the mount's root_path (uvicorn --root-path, Starlette's Mount):
    # matched whole, every balanced request fell through to the app.
    url, seen = upstream
    app = PromptLBMiddleware(noop, config={"nodes": [{"name": "a", "url": url, "models": ["m"]}]})
    transport = httpx.ASGITransport(app=app, root_path="/llm")
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.post(
            "/llm/v1/chat/completions?x=1", json={"model": "m", "messages": []}
        )
        models = await http.get("/llm/v1/models")
    # Mounted at /v1 (a prefix that is part of the routes): the whole path still matches.
    at_v1 = httpx.ASGITransport(app=app, root_path="/v1")
    async with httpx.AsyncClient(transport=at_v1, base_url="http://test") as http:
        whole = await http.post("/v1/chat/completions", json={"model": "m", "messages": []})
    await app.balancer.stop()
    assert response.status_code == 200 and response.headers["x-promptlb-node"] == "a"
    assert models.status_code == 200
    assert whole.status_code == 200
    assert len(seen) == 2


async def test_another_method_on_a_balanced_route_is_a_405_saying_what_is_allowed(
    upstream: tuple[str, list[dict[str, str]]],
) -> None:
    url, seen = upstream
    app = PromptLBMiddleware(noop, config={"nodes": [{"name": "a", "url": url, "models": ["m"]}]})
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as http:
        get = await http.get("/v1/chat/completions")
        put = await http.put("/v1/models")
        head = await http.head("/v1/models")
    await app.balancer.stop()
    assert (get.status_code, get.headers["allow"]) == (405, "POST")
    assert get.json()["error"]["type"] == "invalid_request_error"
    assert (put.status_code, put.headers["allow"]) == (405, "GET, HEAD")
    assert head.status_code == 200
    assert seen == []


async def test_a_query_string_reaches_the_node_as_the_client_encoded_it(serve: Serve) -> None:
    # Re-quoted, raw UTF-8 reached the node encoded twice (%C3%83%C2%A9) and a malformed
    # escape was rewritten (%zz -> %25zz).
    seen: list[bytes] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.raw_path.encode())
        return web.json_response({"choices": []})

    node = web.Application()
    node.router.add_post("/v1/chat/completions", chat)
    async with serve(node) as url:
        nodes = [{"name": "a", "url": url, "models": ["m"]}]
        app = PromptLBMiddleware(noop, config={"health": {"enabled": False}, "nodes": nodes})

        async def send_raw(query: bytes) -> None:
            # By hand: an HTTP client would encode the query itself first.
            body = json.dumps({"model": "m", "messages": []}).encode()
            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/chat/completions",
                "raw_path": b"/v1/chat/completions",
                "query_string": query,
                "headers": [(b"content-type", b"application/json")],
                "client": ("127.0.0.1", 1),
            }
            messages = [{"type": "http.request", "body": body, "more_body": False}]
            statuses: list[int] = []

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await asyncio.sleep(3600)
                return {"type": "http.disconnect"}

            async def send(message: MutableMapping[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            await app(scope, receive, send)
            assert statuses == [200]

        await send_raw(b"a=%C3%A9&b=%zz")
        await send_raw("q=é".encode())
        await send_raw(b"a=\x01b")  # a control byte: escaped, not dropped by the URL type
        await app.balancer.stop()
    assert seen == [
        b"/v1/chat/completions?a=%C3%A9&b=%zz",
        b"/v1/chat/completions?q=%C3%A9",
        b"/v1/chat/completions?a=%01b",
    ]


# A chat completion's ASGI scope, for the tests that drive the app's raw interface.
CHAT_SCOPE: dict[str, Any] = {
    "type": "http",
    "method": "POST",
    "path": "/v1/chat/completions",
    "raw_path": b"/v1/chat/completions",
    "query_string": b"",
    "headers": [(b"content-type", b"application/json")],
}


def _endless_sse(*, sized: bool = False, encoded: bool = False) -> web.Application:
    """A node whose answer streams an event every 20 ms, for good (``sized``: under a declared
    length it never reaches; ``encoded``: labelled gzip, as behind a compressing proxy)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream"}
        if encoded:
            headers["Content-Encoding"] = "gzip"  # (passed on as bytes: never decoded here)
        response = web.StreamResponse(headers=headers)
        if sized:
            response.content_length = 1_000_000
        await response.prepare(request)
        while True:
            await response.write(b'data: {"choices": []}\n\n')
            await asyncio.sleep(0.02)

    return chat_node(chat)


async def raw_stream_call(
    app: PromptLBMiddleware, *, stall_after: int | None = None, limit: float = 4.0
) -> list[dict[str, Any]]:
    """A streamed chat through the app's raw ASGI interface: the messages it sent, the client
    reading nothing after ``stall_after`` of them (still connected). Fails past ``limit``."""
    body = json.dumps({**CHAT_BODY, "stream": True}).encode()
    scope = dict(CHAT_SCOPE)
    stalled = asyncio.Event()  # never set: a stalled client never reads again
    sent: list[dict[str, Any]] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await stalled.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))
        if stall_after is not None and len(sent) > stall_after:
            await stalled.wait()

    call = asyncio.create_task(app(scope, receive, send))
    try:
        done, _ = await asyncio.wait({call}, timeout=limit)
        assert done, "the request never ended"
        call.result()
    finally:
        call.cancel()
    return sent


async def test_a_client_that_stops_reading_a_broken_stream_does_not_hold_its_node(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stream runs out of time while the client takes nothing (connected, its window shut):
    # the closing error event waited on that client for as long as it stayed, the try open,
    # the node counted busy and still generating.
    async with serve(_endless_sse()) as url:
        app = PromptLBMiddleware(
            noop,
            config={
                "nodes": [{"name": "a", "url": url, "models": ["m"]}],
                "retry": {"total_timeout": 0.5},
            },
        )
        monkeypatch.setattr(proxy, "_TRAILER_S", 30.0)  # the closing event's wait on the client
        view = app.balancer.table.nodes["a"].view
        call = asyncio.create_task(raw_stream_call(app, stall_after=2, limit=60.0))
        try:
            for busy in (1, 0):  # the stream under way, then past its deadline (0.5 s)
                for _ in range(300):
                    if view.in_flight == busy:
                        break
                    await asyncio.sleep(0.01)
                assert view.in_flight == busy
            assert not call.done()  # the try let go while the event still waits on the client
        finally:
            call.cancel()
            await app.balancer.stop()


async def _past_deadline(serve: Serve, node: web.Application) -> list[dict[str, Any]]:
    """A streamed chat through a middleware whose answers have 0.3 s, to ``node``'s endless
    stream: the messages it sent."""
    async with serve(node) as url:
        app = PromptLBMiddleware(
            noop,
            config={
                "nodes": [{"name": "a", "url": url, "models": ["m"]}],
                "retry": {"total_timeout": 0.3},
            },
        )
        try:
            return await raw_stream_call(app)
        finally:
            await app.balancer.stop()


async def test_a_compressed_stream_past_its_deadline_closes_with_no_plain_text_event(
    serve: Serve,
) -> None:
    # The error event, plain text after the node's gzip bytes, broke the client's decoding.
    sent = await _past_deadline(serve, _endless_sse(encoded=True))
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert b'"error"' not in body and sent[-1]["more_body"]  # the connection closes on it


async def test_a_stream_past_its_deadline_ends_with_a_504_event_unless_its_length_was_set(
    serve: Serve,
) -> None:
    for sized in (False, True):
        sent = await _past_deadline(serve, _endless_sse(sized=sized))
        body = b"".join(m.get("body", b"") for m in sent[1:])
        last = body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        if sized:
            # A declared length the event would overrun: the body is cut, the connection to
            # close on it (no event, no end of body).
            assert last == b'data: {"choices": []}' and sent[-1]["more_body"]
        else:
            error = json.loads(last.removeprefix(b"data: "))["error"]
            assert (error["code"], error["message"]) == (
                504,
                "upstream stream ran past its deadline",
            )
            assert not sent[-1]["more_body"]


@asynccontextmanager
async def raw_node_app(
    head: bytes,
    answer: bytes,
    *,
    framed: bool = True,
    calls: list[int] | None = None,
    **config: Any,
) -> AsyncIterator[PromptLBMiddleware]:
    """The middleware (``config`` the rest of its config) over one node that answers 200 with
    the raw header lines ``head`` (what aiohttp's own server refuses to send) and ``answer``:
    with its length, or (not ``framed``) ended by closing the connection, as HTTP/1.0 has it.
    Each answer is counted into ``calls``."""

    async def raw_node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = (await reader.readuntil(b"\r\n\r\n")).lower()
        length = got.partition(b"content-length:")[2].partition(b"\r\n")[0]
        await reader.readexactly(int(length or 0))
        if calls is not None:
            calls.append(1)
        frame = b"Content-Length: %d\r\n" % len(answer) if framed else b"Connection: close\r\n"
        writer.write(b"HTTP/1.1 200 OK\r\n%s%s\r\n%s" % (head, frame, answer))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(raw_node, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        url = f"http://127.0.0.1:{port}"
        nodes = [{"name": "a", "url": url}]
        app = PromptLBMiddleware(
            noop, config={"nodes": nodes, "health": {"enabled": False}, **config}
        )
        try:
            yield app
        finally:
            await app.balancer.stop()


def chat_once() -> Callable[[], Awaitable[dict[str, Any]]]:
    given = [{"type": "http.request", "body": json.dumps(CHAT_BODY).encode()}]

    async def receive() -> dict[str, Any]:
        if given:
            return given.pop()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return receive


async def test_an_answer_ended_by_the_connections_close_is_never_cached() -> None:
    # Without a length or chunks, a node dying mid-answer looks like its end: the cut answer
    # was kept and served as a fresh hit, and stale for a day.
    calls: list[int] = []
    head = b"Content-Type: application/json\r\n"
    cut = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "The ans'
    cache = {"serve_fresh": True}
    async with (
        raw_node_app(head, cut, framed=False, calls=calls, cache=cache) as app,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http,
    ):
        body = {**CHAT_BODY, "temperature": 0}
        for _ in range(2):
            got = await http.post("/v1/chat/completions", json=body)
            assert got.content == cut and "x-promptlb-cache" not in got.headers
            await asyncio.sleep(0.05)  # (a store is written in the background)
    assert len(calls) == 2


@pytest.mark.parametrize("reason", ["abort", "stop", "eos_token"])
async def test_an_answer_the_engine_cut_is_never_cached(reason: str) -> None:
    # finish_reason "abort" (vLLM's pause with abort): half an answer, kept and served again.
    calls: list[int] = []
    head = b"Content-Type: application/json\r\n"
    choice = {"index": 0, "message": {"role": "assistant", "content": "The"}}
    answer = json.dumps({"choices": [{**choice, "finish_reason": reason}]}).encode()
    cache = {"serve_fresh": True}
    async with (
        raw_node_app(head, answer, calls=calls, cache=cache) as app,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http,
    ):
        for _ in range(2):
            assert (await http.post("/v1/chat/completions", json=CHAT_BODY)).content == answer
            await asyncio.sleep(0.05)  # (a store is written in the background)
    assert len(calls) == (2 if reason == "abort" else 1)


async def test_a_nodes_own_batch_header_is_not_passed_on(serve: Serve) -> None:
    # A node that is another promptlb sent x-promptlb-batch: passed on, it told a caller this
    # gateway never batched that it had been batched with nine others.
    async def embed(request: web.Request) -> web.Response:
        data = [{"object": "embedding", "index": 0, "embedding": [0.0]}]
        return web.json_response({"data": data}, headers={"x-promptlb-batch": "9"})

    async with gateway_over(serve, {"/v1/embeddings": embed}) as (_, http):
        got = await http.post("/v1/embeddings", json={"model": "m", "input": [1, 2, 3]})
        assert got.status_code == 200 and "x-promptlb-batch" not in got.headers


async def test_headers_the_server_refuses_are_the_nodes_failure() -> None:
    # uvicorn refuses a header value with a control character after marking the response
    # started: the client's connection closes. The try was settled as the client's doing
    # ("aborted"), so the node was never charged and kept every request it broke.
    head = b"Content-Type: application/json\r\nX-Odd: a\x01b\r\n"
    async with raw_node_app(head, b'{"choices": []}') as app:

        async def send(message: MutableMapping[str, Any]) -> None:
            # What uvicorn's httptools protocol does with such a value.
            if message["type"] == "http.response.start" and any(
                b"\x01" in value for _, value in message["headers"]
            ):
                raise RuntimeError("Invalid HTTP header value.")

        with pytest.raises(RuntimeError):
            await app(dict(CHAT_SCOPE), chat_once(), send)
        node = app.balancer.table.nodes["a"]
        assert node.failures == 1 and node.view.in_flight == 0


async def test_a_content_type_that_is_no_utf8_is_passed_on_with_its_answer() -> None:
    # aiohttp reads the byte as a lone surrogate: encoding it raised after the headers were
    # sent, so the client had a 200 with no body and a cut connection.
    answer = b'{"choices": []}'
    async with raw_node_app(b"Content-Type: application/json; charset=\xe9\r\n", answer) as app:
        sent: list[MutableMapping[str, Any]] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        await app(dict(CHAT_SCOPE), chat_once(), send)
        start, *bodies = sent
        assert start["status"] == 200
        assert (b"content-type", b"application/json; charset=\xe9") in start["headers"]
        assert b"".join(m.get("body", b"") for m in bodies) == answer
        assert not bodies[-1].get("more_body")
