"""One mapping from a refusal to an answer: the proxy, the embedding batcher and the in-app
client refuse the same request alike (status, error body, headers)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from promptlb.middleware import PromptLBError, PromptLBMiddleware
from promptlb.middleware._answer import Answer, answer_headers
from promptlb.middleware._cache import CacheEntry
from promptlb.middleware._refusals import (
    BadRequest,
    Exhausted,
    NoNodeAvailable,
    Shed,
    TooLarge,
    UnknownModel,
    UpstreamError,
)


@pytest.mark.parametrize(
    ("refusal", "status", "kind", "headers"),
    [
        (BadRequest("`model` is required", "model"), 400, "invalid_request_error", []),
        (TooLarge(1024), 413, "invalid_request_error", [(b"connection", b"close")]),
        (UnknownModel("m"), 404, "model_not_found", []),
        (NoNodeAvailable("m"), 503, "service_unavailable", [(b"retry-after", b"5")]),
        (
            UpstreamError(502, "every try failed", 3),
            502,
            "upstream_error",
            [(b"x-promptlb-attempts", b"3"), (b"retry-after", b"5")],
        ),
        (Shed("m", 2), 429, "rate_limit_error", [(b"retry-after", b"2")]),
        (
            Exhausted("m", ["m: down", "cache: no answer"], 2),
            503,
            "service_unavailable",
            [(b"x-promptlb-attempts", b"2"), (b"retry-after", b"5")],
        ),
    ],
)
def test_each_refusal_knows_its_status_body_and_headers(
    refusal: Exception, status: int, kind: str, headers: list[tuple[bytes, bytes]]
) -> None:
    from promptlb.middleware._refusals import Refusal

    assert isinstance(refusal, Refusal)
    assert refusal.status == status
    error = refusal.error()["error"]
    assert error == {"message": str(refusal), "type": kind, "param": refusal.param, "code": status}
    assert refusal.headers(b"5") == headers


def test_the_answer_headers_say_how_the_answer_was_made() -> None:
    entry = CacheEntry(body=b"{}", model="m", created=0.0)
    fresh = Answer("m", entry=entry, attempts=0)
    assert answer_headers(fresh) == [
        (b"x-promptlb-node", b"cache"),
        (b"x-promptlb-model", b"m"),
        (b"x-promptlb-attempts", b"0"),
        (b"x-promptlb-cache", b"hit"),
    ]
    stale = Answer("m", entry=entry, degraded="cache", attempts=2)
    assert answer_headers(stale)[-1] == (b"x-promptlb-degraded", b"cache")
    assert (b"x-promptlb-cache", b"hit") not in answer_headers(stale)


async def _noop(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the app is not reached for balanced routes")


async def _refusals(
    body: dict[str, Any],
) -> tuple[tuple[int, dict[str, Any], dict[str, str]], ...]:
    """The same refused embeddings request through the proxy, the batcher and the client."""
    nodes = [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}]  # nothing listens
    health = {"interval": "2s", "timeout": "200ms"}
    plain = PromptLBMiddleware(_noop, config={"nodes": nodes, "health": health})
    batching = PromptLBMiddleware(
        _noop,
        config={"nodes": nodes, "health": health, "batching": {"enabled": True}},
    )
    answers = []
    try:
        for app in (plain, batching):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                got = await http.post("/v1/embeddings", content=json.dumps(body))
            kept = {k: v for k, v in got.headers.items() if k in ("retry-after",)}
            answers.append((got.status_code, got.json(), kept))
        with pytest.raises(PromptLBError) as info:
            await plain.client.embeddings(**body)
        assert info.value.node is None
        assert isinstance(info.value.body, dict)
        answers.append((info.value.status, info.value.body, answers[0][2]))
    finally:
        await plain.dispatcher.stop()
        await batching.dispatcher.stop()
    return tuple(answers)


@pytest.mark.parametrize(
    ("model", "status", "kind"),
    [("unknown", 404, "model_not_found"), ("m", 503, "service_unavailable")],
)
async def test_the_proxy_the_batcher_and_the_client_refuse_alike(
    model: str, status: int, kind: str
) -> None:
    proxy, batcher, client = await _refusals({"model": model, "input": ["a", "b"]})
    assert proxy == batcher == client
    assert proxy[0] == status and proxy[1]["error"]["type"] == kind
    if status == 503:
        assert proxy[2] == {"retry-after": "2"}  # the health-check interval
