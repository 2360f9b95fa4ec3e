"""What the gateway refuses before any node sees it, and what it passes on: in process, against a
capturing upstream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from promptlb.middleware import PromptLBMiddleware
from promptlb.middleware._config import load_config
from promptlb.middleware._nodes import NodeTable
from promptlb.middleware._refusals import BadRequest
from promptlb.middleware._request import RequestReader, route_of
from promptlb.middleware._shedding import Admission

from tests.conftest import Serve
from tests.middleware.conftest import chat_node

Seen = list[dict[str, str]]


@pytest.fixture
async def upstream(serve: Serve) -> AsyncIterator[tuple[str, Seen]]:
    """A node that answers every chat 200 and keeps the headers it was sent."""
    seen: Seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response({"choices": []})

    async with serve(chat_node(handler)) as url:
        yield url, seen


async def noop(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the app is not reached for balanced routes")


def gateway(url: str, **extra: Any) -> PromptLBMiddleware:
    return PromptLBMiddleware(
        noop, config={"nodes": [{"name": "a", "url": url, "models": ["m", "small"]}], **extra}
    )


async def post_raw(
    app: PromptLBMiddleware, body: bytes, headers: dict[str, str] | None = None
) -> httpx.Response:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as http:
        sent = {"content-type": "application/json", **(headers or {})}
        return await http.post("/v1/chat/completions", content=body, headers=sent)


def chat(content: str = "hi", **fields: Any) -> bytes:
    # json.dumps writes a lone surrogate as the escape \ud800, as any client would send it.
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    ).encode()


NESTED = b'{"model": "m", "x": ' + b"[" * 100 + b"]" * 100 + b"}"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (chat("\ud800"), "messages[0].content", "unpaired UTF-16 surrogate"),  # the probe
        (chat("tail \udfff"), "messages[0].content", "unpaired UTF-16 surrogate"),
        (chat(max_tokens=1_000_000_000_000), "max_tokens", "at most 10000000"),  # the probe
        (chat(max_completion_tokens=10_000_001), "max_completion_tokens", "at most 10000000"),
        (json.dumps({"model": "small", "max_tokens": 5000}).encode(), "max_tokens", "4096"),
        (
            json.dumps({"model": "small", "max_tokens": 9, "max_completion_tokens": 5000}).encode(),
            "max_completion_tokens",
            "4096",
        ),
        (NESTED, None, "nests deeper than 64 levels"),
        (b"[" * 1000, None, "not valid JSON"),  # the probe: 2 KB of brackets, once a 500
        (b"[" * 100_000 + b"]" * 100_000, None, "not valid JSON"),  # a RecursionError
        # A lone surrogate written raw (CESU-style bytes, not UTF-8): no escape to see.
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
            None,
            "not valid JSON",
        ),
        # UTF-16 spells no `\ud` escape in its bytes: walked whole, the surrogate is found.
        ('{"model": "m", "x": "\\ud800"}'.encode("utf-16"), "x", "unpaired UTF-16 surrogate"),
        # In a key: the param is the object holding it.
        (b'{"model": "m", "x": [{"y": {"\\ud800": 1}}]}', "x[0].y", "unpaired UTF-16"),
        # Echoed in a response header: a control character there dropped the connection.
        (json.dumps({"model": "x\nY", "messages": []}).encode(), "model", "printable"),
        (json.dumps({"model": "m" * 300, "messages": []}).encode(), "model", "at most 256"),
        # A node may take "true" for true; routing and the cache would not.
        (
            json.dumps({"model": "m", "messages": [], "stream": "true"}).encode(),
            "stream",
            "true or false",
        ),
    ],
)
async def test_what_no_node_should_see_is_a_400_in_the_openai_shape(
    upstream: tuple[str, Seen], body: bytes, param: str | None, message: str
) -> None:
    url, seen = upstream
    app = gateway(url, requests={"context": {"small": 4096}})
    response = await post_raw(app, body)
    await app.balancer.stop()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == 400
    assert error["param"] == param
    assert message in error["message"]
    assert seen == []  # no node saw it, so no node can be blamed for it


async def test_what_is_well_formed_passes(upstream: tuple[str, Seen]) -> None:
    url, seen = upstream
    app = gateway(url, requests={"context": {"small": 4096}})
    ok = [
        chat("\U0001f600"),  # written by json.dumps as a paired escape, \ud83d\ude00
        chat(r"a backslash, then ud800: \ud800".replace("\\", "\\\\")),
        chat(max_tokens=10_000_000),
        json.dumps({"model": "small", "max_tokens": 4096}).encode(),
        # The node reads max_completion_tokens: the other, ignored, refused it all the same.
        json.dumps({"model": "small", "max_tokens": 10**5, "max_completion_tokens": 9}).encode(),
        b'{"model": "m", "x": ' + b"[" * 60 + b"]" * 60 + b"}",
        b"\xef\xbb\xbf" + chat(),  # with a UTF-8 byte-order mark
        json.dumps({"model": "m", "messages": []}).encode("utf-16"),  # UTF-16, as JSON allows
    ]
    for body in ok:
        assert (await post_raw(app, body)).status_code == 200, body[:80]
    await app.balancer.stop()
    assert len(seen) == len(ok)


async def test_client_only_headers_do_not_reach_the_node(upstream: tuple[str, Seen]) -> None:
    url, seen = upstream
    client = {
        "Cookie": "session=abc",
        "x-promptlb-priority": "sheddable",
        "x-promptlb-priority-token": "a-secret",
        "x-promptlb-no-fallback": "1",
        "X-Forwarded-For": "10.0.0.5",
        "Forwarded": "for=10.0.0.5",
        "X-Real-IP": "10.0.0.5",
        "X-Trace": "t1",
    }
    plain = gateway(url)
    behind = gateway(url, forward_client_address=True)
    for app in (plain, behind):
        assert (await post_raw(app, chat(), client)).status_code == 200
        await app.balancer.stop()
    first, second = seen
    assert first["x-trace"] == "t1"
    for name in ("cookie", "x-forwarded-for", "forwarded", "x-real-ip"):
        assert name not in first, name
    assert not any(name.startswith("x-promptlb-") for name in first)
    # configured: the client's address claims pass on (a proxy in front vouches for them)
    assert second["x-forwarded-for"] == "10.0.0.5"
    assert second["forwarded"] == "for=10.0.0.5"
    assert "cookie" not in second


async def test_an_error_body_names_no_node_address(refused_port: int) -> None:
    port = refused_port
    app = gateway(f"http://127.0.0.1:{port}", health={"enabled": False})
    response = await post_raw(app, chat())
    await app.balancer.stop()
    assert response.status_code == 502
    text = response.text
    assert "127.0.0.1" not in text and str(port) not in text
    assert "could not reach a node" in response.json()["error"]["message"]


async def test_a_body_that_stops_coming_is_a_408_and_the_connection_closes(
    upstream: tuple[str, Seen],
) -> None:
    url, seen = upstream
    app = gateway(url, requests={"body_timeout": "200ms"})

    async def body() -> AsyncIterator[bytes]:
        yield b'{"model": "m",'
        await asyncio.sleep(3600)  # the next byte never comes
        yield b"}"

    async with (
        asyncio.timeout(5),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http,
    ):
        response = await http.post("/v1/chat/completions", content=body())
    await app.balancer.stop()
    assert response.status_code == 408
    assert response.headers["connection"] == "close"
    assert "not received within 0.2s" in response.json()["error"]["message"]
    assert seen == []


@pytest.mark.parametrize("zeros", [24, 5000])
async def test_a_length_with_leading_zeros_is_its_number(
    upstream: tuple[str, Seen], zeros: int
) -> None:
    """RFC 9110's 1*DIGIT: counted by its digits, 24 of them (mostly zeros) read as too long;
    past 4,300 of them int() raised, a 500."""
    url, _ = upstream
    app = gateway(url)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    headers = {"content-length": str(len(body)).zfill(zeros), "content-type": "application/json"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as http:
        request = http.build_request("POST", "/v1/chat/completions", headers=headers, content=body)
        response = await http.send(request)
    await app.balancer.stop()
    assert response.status_code not in (413, 500)


def test_the_answer_asked_is_read_as_a_node_reads_it() -> None:
    """vLLM takes max_completion_tokens or max_tokens: by max_tokens first, a 5,000-token
    answer read as 100 (its slow try charged to the node, a lighter model fitted to it); by
    the longer, 100 tokens asked with max_tokens 100,000 excused a hung node's timeout."""
    both = {"model": "m", "max_tokens": 100, "max_completion_tokens": 5000}
    assert route_of(both, 10).max_tokens == 5000
    assert (
        route_of({**both, "max_tokens": 100_000, "max_completion_tokens": 100}, 10).max_tokens
        == 100
    )
    assert route_of({**both, "max_completion_tokens": None}, 10).max_tokens == 100
    assert route_of({"model": "m", "max_tokens": True}, 10).max_tokens is None
    # A completion has no max_completion_tokens (vLLM ignores it there): read, it excused a
    # node fifty times the time its answer takes.
    config = load_config({"nodes": [{"name": "a", "url": "http://a:1"}]})
    reader = RequestReader(config, Admission(config.shedding, NodeTable(config)))
    done = {"model": "m", "prompt": "hi", "max_tokens": 100, "max_completion_tokens": 5000}
    assert reader.build("/v1/completions", done).route.max_tokens == 100
    assert reader.build("/v1/chat/completions", done).route.max_tokens == 5000
    # Embeddings read neither (not refused for a field the node ignores); a route of no
    # known reading has both held to the context.
    config = load_config(
        {"nodes": [{"name": "a", "url": "http://a:1"}], "requests": {"context": {"m": 4096}}}
    )
    reader = RequestReader(config, Admission(config.shedding, NodeTable(config)))
    for first, second in ((9, 5000), (5000, 9)):
        body = {"model": "m", "input": "x", "max_tokens": first, "max_completion_tokens": second}
        reader.build("/v1/embeddings", body)
        with pytest.raises(BadRequest):
            reader.build("/v1/responses", body)


@pytest.mark.parametrize("declared", [str(10**12), "9" * 5000])
async def test_a_body_over_the_limit_is_a_413_and_the_connection_closes(
    upstream: tuple[str, Seen], declared: str
) -> None:
    # Kept alive, the server would read the rest of a declared terabyte, a byte at a time.
    # A length of 5,000 digits (a server that passes it on) raised in int(): a 500.
    url, seen = upstream
    app = gateway(url, max_body_bytes=1024)
    headers = {"content-length": declared, "content-type": "application/json"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as http:
        request = http.build_request("POST", "/v1/chat/completions", headers=headers, content=b"{")
        response = await http.send(request)
    await app.balancer.stop()
    assert response.status_code == 413
    assert response.headers["connection"] == "close"
    assert seen == []
