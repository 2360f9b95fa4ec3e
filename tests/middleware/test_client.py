"""The in-app client (`request.state.promptlb`): what it raises when a node's answer is not
what it expects, against in-process nodes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from promptlb.middleware import PromptLBError, PromptLBMiddleware

from tests.conftest import Serve
from tests.middleware.conftest import chat_node

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HI = [{"role": "user", "content": "hi"}]


async def noop(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the app is not reached")


async def collect(stream: AsyncIterator[dict[str, Any]], into: list[dict[str, Any]]) -> None:
    async for event in stream:
        into.append(event)


@asynccontextmanager
async def middleware_over(
    serve: Serve, chat: Handler, **config: Any
) -> AsyncIterator[PromptLBMiddleware]:
    async with serve(chat_node(chat)) as url:
        app = PromptLBMiddleware(
            noop, config={**config, "nodes": [{"name": "a", "url": url, "models": ["m"]}]}
        )
        try:
            yield app
        finally:
            await app.balancer.stop()


async def test_a_node_error_that_is_not_json_is_a_promptlb_error(serve: Serve) -> None:
    async def chat(request: web.Request) -> web.Response:
        return web.Response(status=500, text="Internal Server Error")

    async with middleware_over(serve, chat) as app:
        with pytest.raises(PromptLBError) as raised:
            await app.client.chat(model="m", messages=HI)
    assert raised.value.status == 500 and raised.value.node == "a"
    assert raised.value.body == "Internal Server Error"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_nodes_refusal_keeps_its_retry_hint_and_promptlbs_headers(
    serve: Serve, stream: bool
) -> None:
    """An HTTP client got the node's Retry-After with its 429; the app got the body alone,
    and no way to back off as told."""

    async def chat(request: web.Request) -> web.Response:
        error = {"error": {"message": "slow down"}}
        return web.json_response(error, status=429, headers={"Retry-After": "7"})

    async with middleware_over(serve, chat) as app:
        call = (
            collect(app.client.chat_stream(model="m", messages=HI), [])
            if stream
            else app.client.chat(model="m", messages=HI)
        )
        with pytest.raises(PromptLBError) as raised:
            await call
    assert raised.value.status == 429 and raised.value.headers["retry-after"] == "7"
    assert raised.value.headers["x-promptlb-node"] == "a"


async def test_promptlbs_own_refusal_carries_its_retry_hint() -> None:
    """No node answers: the proxy's 502 says when to come back; the app's error said
    nothing."""
    dead = {"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}
    app = PromptLBMiddleware(noop, config={"nodes": [dead], "health": {"enabled": False}})
    try:
        with pytest.raises(PromptLBError) as raised:
            await app.client.chat(model="m", messages=HI)
    finally:
        await app.balancer.stop()
    assert raised.value.status == 502 and raised.value.node is None, raised.value.headers
    assert int(raised.value.headers["retry-after"]) >= 1
    assert "connection" not in raised.value.headers


async def test_a_200_carrying_an_error_is_a_promptlb_error(serve: Serve) -> None:
    """It was handed back to the app as the answer, where the batcher makes it a 502."""

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "engine overloaded"}})

    async with middleware_over(serve, chat) as app:
        with pytest.raises(PromptLBError) as raised:
            await app.client.chat(model="m", messages=HI)
    assert raised.value.status == 502 and raised.value.node == "a"
    assert raised.value.body == {"error": {"message": "engine overloaded"}}
    assert raised.value.headers["x-promptlb-node"] == "a"  # as every node error carries them


@pytest.fixture
async def stalled() -> AsyncIterator[tuple[Handler, asyncio.Event]]:
    """A node that sends its headers and a first piece, then nothing until released."""
    release = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        stream = (await request.json()).get("stream", False)
        kind = "text/event-stream" if stream else "application/json"
        response = web.StreamResponse(headers={"Content-Type": kind})
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\n' if stream else b'{"choices": ')
        await asyncio.wait_for(release.wait(), 10)
        return response

    yield chat, release
    release.set()


async def test_the_answer_is_held_to_the_total_deadline(
    serve: Serve, stalled: tuple[Handler, asyncio.Event]
) -> None:
    """As on the proxy's path: a node that stalls after its first bytes is cut off at the
    request's deadline, and the failure is the node's."""
    chat, release = stalled
    async with middleware_over(serve, chat, retry={"total_timeout": "1s"}) as app:
        started = time.monotonic()
        with pytest.raises(PromptLBError) as whole:
            await asyncio.wait_for(app.client.chat(model="m", messages=HI), 5)
        assert whole.value.status == 504 and whole.value.node == "a"
        assert time.monotonic() - started < 3
        events: list[dict[str, Any]] = []
        with pytest.raises(PromptLBError) as streamed:
            await asyncio.wait_for(
                collect(app.client.chat_stream(model="m", messages=HI), events), 5
            )
        assert events == [{"choices": []}]  # what came before the deadline
        assert streamed.value.status == 504
        assert whole.value.body["error"]["type"] == "upstream_error"  # type: ignore[index]
        # The headers the proxy had sent before the answer broke off.
        assert whole.value.headers["x-promptlb-node"] == streamed.value.headers["x-promptlb-node"]
        assert whole.value.headers["x-promptlb-node"] == "a"
        metrics = app.balancer.metrics.render().decode()
        assert app.balancer.table.nodes["a"].view.in_flight == 0
        release.set()  # the node's handlers end: its server can close
    assert 'outcome="broken"} 2.0' in metrics and 'outcome="aborted"' not in metrics


async def test_a_nodes_502_that_breaks_off_does_not_keep_its_body_headers(serve: Serve) -> None:
    """The error's body is made here: the node's Content-Length of 1,000 went with it (kept
    when the status matched the node's own)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            status=502, headers={"Content-Type": "text/html", "Content-Length": "1000"}
        )
        await response.prepare(request)
        await response.write(b"<html>bad gateway")
        assert request.transport is not None
        request.transport.close()  # broken off, 983 bytes short
        return response

    async with middleware_over(serve, chat, retry={"attempts": 1}) as app:
        with pytest.raises(PromptLBError) as raised:
            await app.client.chat(model="m", messages=HI)
    assert raised.value.status == 502 and raised.value.body["error"]["type"] == "upstream_error"  # type: ignore[index]
    assert "content-length" not in raised.value.headers
    assert raised.value.headers["x-promptlb-node"] == "a"


async def test_an_event_that_is_not_json_is_a_promptlb_error(serve: Serve) -> None:
    async def chat(request: web.Request) -> web.Response:
        body = b'data: {"choices": []}\n\ndata: {"choi\n\n'
        return web.Response(body=body, content_type="text/event-stream")

    async with middleware_over(serve, chat) as app:
        events: list[dict[str, Any]] = []
        with pytest.raises(PromptLBError) as raised:
            await collect(app.client.chat_stream(model="m", messages=HI), events)
    assert events == [{"choices": []}]
    assert raised.value.status == 502 and raised.value.node == "a"


async def test_a_nodes_error_answer_is_charged_to_the_node_as_on_the_proxys_path(
    serve: Serve,
) -> None:
    """Raised inside the answer's block, the error was settled as the caller giving up: a node
    answering 500 to in-app calls was never charged (never ejected, never avoided)."""

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "boom"}}, status=500)

    async with middleware_over(serve, chat, health={"enabled": False}) as app:
        with pytest.raises(PromptLBError) as raised:
            await app.client.chat(model="m", messages=HI)
        assert raised.value.status == 500
        with pytest.raises(PromptLBError) as raised:
            await collect(app.client.chat_stream(model="m", messages=HI), [])
        assert raised.value.status == 500 and "boom" in str(raised.value.body)
        node = app.balancer.table.nodes["a"]
        assert (node.requests, node.failures, node.view.in_flight) == (2, 2, 0)
        aborted = app.balancer.metrics.registry.get_sample_value(
            "promptlb_requests_total", {"node": "a", "outcome": "aborted"}
        )
        assert not aborted


@pytest.mark.parametrize(
    ("body", "content_type", "seen"),
    [
        # A node's error event inside a 200 stream (vLLM's when generation fails; the proxy's
        # own when a stream breaks): handed to the app as an event, then a normal end.
        (
            b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
            b'data: {"error": {"message": "generation failed"}}\n\n',
            "text/event-stream",
            1,
        ),
        # Cut off: no [DONE] and no choice that finished.
        (b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n', "text/event-stream", 1),
        # A JSON body sent as 200 to a streaming request: no event and no error at all.
        (b'{"error": {"message": "model overloaded"}}', "application/json", 0),
    ],
)
async def test_a_stream_that_fails_or_stops_short_raises(
    serve: Serve, body: bytes, content_type: str, seen: int
) -> None:
    async def chat(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type)

    async with middleware_over(serve, chat) as app:
        events: list[dict[str, Any]] = []
        with pytest.raises(PromptLBError) as raised:
            await collect(app.client.chat_stream(model="m", messages=HI), events)
        metrics = app.balancer.metrics.render().decode()
    assert len(events) == seen
    assert raised.value.status == 502 and raised.value.node == "a"
    # The proxy's headers; less those of the node's body where this error's body is not it
    # (a stream's error), with them where it is (the node's JSON sent to a stream).
    assert raised.value.headers["x-promptlb-node"] == "a"
    assert ("content-type" in raised.value.headers) is (seen == 0)
    if seen:  # a stream's failure is the node's, not the app giving up
        assert 'outcome="aborted"' not in metrics
        assert app.balancer.table.nodes["a"].failures == 1


async def streamed(serve: Serve, body: bytes) -> tuple[list[dict[str, Any]], int]:
    """The in-app stream's events from a node that sends ``body`` as its SSE, and the node's
    failures after it."""

    async def chat(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/event-stream")

    async with middleware_over(serve, chat) as app:
        events: list[dict[str, Any]] = []
        await collect(app.client.chat_stream(model="m", messages=HI), events)
        return events, app.balancer.table.nodes["a"].failures


async def test_a_stream_whose_events_carry_a_null_error_is_no_failure(serve: Serve) -> None:
    events, failures = await streamed(
        serve,
        b'data: {"choices": [{"delta": {"content": "a"}}], "error": null}\n\n'
        b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}], "error": null}\n\n'
        b"data: [DONE]\n\n",
    )
    assert len(events) == 2 and failures == 0


async def test_a_stream_without_done_ends_with_its_finished_choice(serve: Serve) -> None:
    # Some servers send no [DONE]: a choice that says why it ended is the end; and a last
    # event with no newline after it was dropped.
    events, _ = await streamed(
        serve,
        b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}\n\n'
        b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}',
    )
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "stop"]


@pytest.mark.parametrize("stream", [False, True])
async def test_in_app_answers_fill_the_cache_as_proxied_ones_do(serve: Serve, stream: bool) -> None:
    # An app that only called in-app never filled it: no fresh hits, no outage stand-ins.
    calls = []

    async def chat(request: web.Request) -> web.StreamResponse:
        calls.append(1)
        if not stream:
            message = {"role": "assistant", "content": "hello"}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            return web.json_response({"object": "chat.completion", "choices": [choice]})
        first = {"index": 0, "delta": {"role": "assistant", "content": "hel"}}
        last = {"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}
        events = b"".join(
            b"data: " + json.dumps({"choices": [c]}).encode() + b"\n\n" for c in (first, last)
        )
        events += b"data: [DONE]\n\n"
        return web.Response(body=events, content_type="text/event-stream")

    async with middleware_over(serve, chat, cache={"serve_fresh": True}) as app:
        said = []
        for _ in range(2):
            if stream:
                events: list[dict[str, Any]] = []
                stream_it = app.client.chat_stream(model="m", messages=HI, temperature=0)
                await collect(stream_it, events)
                text = "".join(
                    e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]
                )
                said.append(stream_it.headers)
            else:
                answer = await app.client.chat(model="m", messages=HI, temperature=0)
                text = answer["choices"][0]["message"]["content"]
                said.append(answer.headers)
            assert text == "hello"
            await asyncio.sleep(0.05)  # the store is written in the background
    assert len(calls) == 1
    # As the proxy's headers say it: the node's answer, then a stored one (an app could not
    # tell a stored answer, up to a day old in an outage, from a fresh one).
    assert said[0]["x-promptlb-node"] == "a" and "x-promptlb-cache" not in said[0]
    assert said[1]["x-promptlb-node"] == "cache" and said[1]["x-promptlb-cache"] == "hit"


async def test_a_body_over_max_body_bytes_is_refused_in_app_as_over_http(serve: Serve) -> None:
    async def chat(request: web.Request) -> web.Response:
        raise AssertionError("no node sees what the proxy refuses")

    async with middleware_over(serve, chat, max_body_bytes=1024) as app:
        with pytest.raises(PromptLBError) as raised:
            await app.client.chat(model="m", messages=[{"role": "user", "content": "x" * 4096}])
    assert raised.value.status == 413


async def test_text_in_another_script_reaches_the_node_as_a_client_sends_it(serve: Serve) -> None:
    """As UTF-8, not ASCII escapes: 600 kB of CJK text was 1.2 MB in app, refused under a
    1 MB limit the proxy let it through, and read as twice the tokens by the strategies."""
    received: list[bytes] = []

    async def chat(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.json_response({"choices": [{"index": 0, "message": {"content": "ok"}}]})

    text = "漢" * 200_000
    async with middleware_over(serve, chat, max_body_bytes=1_000_000) as app:
        await app.client.chat(model="m", messages=[{"role": "user", "content": text}])
        built = app._live.reader.build("/v1/chat/completions", {"model": "m", "messages": []})
    assert len(received) == 1 and text.encode() in received[0]
    assert len(received[0]) < 610_000
    assert built.for_model("small").raw == b'{"model": "small", "messages": []}'
    # A lone surrogate, which UTF-8 cannot hold, is still refused by name, not a traceback.
    async with middleware_over(serve, chat) as app:
        with pytest.raises(PromptLBError) as raised:
            await app.client.chat(model="m", messages=[{"role": "user", "content": "a\ud800"}])
    assert raised.value.status == 400 and "surrogate" in str(raised.value)


async def test_a_call_under_way_through_a_reload_keeps_its_dispatcher(serve: Serve) -> None:
    # Its answer went into the cache of the config reloaded meanwhile.
    answering = asyncio.Event()
    go_on = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        answering.set()
        await go_on.wait()
        message = {"role": "assistant", "content": "hello"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return web.json_response({"object": "chat.completion", "choices": [choice]})

    async with middleware_over(serve, chat, cache={"serve_fresh": True}) as app:
        old = app.dispatcher
        call = asyncio.create_task(app.client.chat(model="m", messages=HI, temperature=0))
        await answering.wait()
        nodes = [{"name": "a", "url": app.config.nodes[0].url, "models": ["m"]}]
        new_cache = {"serve_fresh": True, "max_bytes": 4_000_000}  # a store of its own
        assert await app.reload({"nodes": nodes, "cache": new_cache})
        new = app.dispatcher
        assert new is not old
        go_on.set()
        await call
        body = {"model": "m", "messages": HI, "temperature": 0}
        key = old.key(app._live.reader.build("/v1/chat/completions", body), "m")
        assert key is not None and old.cache is not None
        for _ in range(200):  # the store is written in the background
            if await old.cache.get(key) is not None:
                break
            await asyncio.sleep(0.01)
        assert await old.cache.get(key) is not None
        assert new.cache is not None and await new.cache.get(key) is None
