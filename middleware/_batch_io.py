"""The batcher's I/O: a caller's way upstream through the dispatcher, reading the node's answer
whole, and answering the caller (or noticing that it left)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any

import aiohttp

from ._answer import NODE_DROPPED, Answer, answer_headers, node_headers
from ._asgi import RequestWatch, Send, json_error, send_json
from ._batch import Fetch, Reply, fail
from ._degrade import Dispatcher
from ._refusals import Refusal
from ._replies import carries_error
from ._request import Request

__all__ = ["respond", "unless_gone", "upstream"]

_log = logging.getLogger("promptlb.middleware")
# The node's headers a caller's answer does not take: as the proxy's (the batcher's own header
# among them), and those of the body that is written anew (its length, type, encoding).
_REWRITTEN = NODE_DROPPED | {b"content-length", b"content-type", b"content-encoding", b"etag"}


def upstream(dispatch: Dispatcher, request: Request) -> Fetch:
    """A caller's way upstream through the dispatcher, with a refusal as a `Reply` of the
    status, body and headers that the proxy would have answered."""

    async def fetch(body: dict[str, Any]) -> Reply:
        try:
            async with dispatch.answer(request.with_body(body)) as it:
                return await _read(it)
        except Refusal as exc:
            headers = exc.headers(dispatch.retry_after)
            return fail(exc.status, str(exc), exc.kind, *headers, param=exc.param)

    return fetch


async def _read(answer: Answer) -> Reply:
    """The whole answer, parsed; a node's error as the node worded it, its code too, and the
    node's own headers (rate limits, request ids) with either, as the proxy passes them on."""
    up = answer.upstream
    headers = answer_headers(answer)
    status = 200
    if up is None:
        assert answer.entry is not None
        data = answer.entry.body
    else:
        status = up.response.status
        headers += node_headers(up.response, _REWRITTEN)
        try:
            async with asyncio.timeout_at(up.deadline):
                data = answer.first + await up.response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            broken, why = up.broke(exc)
            _log.debug("answer of node %s broke: %r", up.node.name, exc)
            return fail(broken, f"upstream answer {why}", "upstream_error", *headers)
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    if status != 200 or carries_error(parsed):
        # A 200 that carries an error is no answer: the node's words, as a bad gateway.
        shown = status if status != 200 else 502
        return Reply(shown, {"error": _node_error(parsed, shown)}, headers=tuple(headers))
    if not isinstance(parsed, dict):
        return fail(502, "upstream answer is not a JSON object", "upstream_error", *headers)
    return Reply(200, parsed, headers=tuple(headers))


def _node_error(parsed: object, status: int) -> dict[str, Any]:
    """A node's error as it worded it, in OpenAI's shape: OpenAI's ``{"error": {...}}`` (its
    ``code`` kept: clients tell insufficient_quota from rate_limit_exceeded by it, where a
    batched caller got the status), vLLM's older top-level ``{"object": "error", "message":
    ...}`` or TEI's ``{"error": "...", "error_type": ...}``; each but the first became
    "upstream answered 4xx"."""
    error: object = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, str) and isinstance(parsed, dict):
        error = {"message": error, "type": parsed.get("error_type")}
    elif not isinstance(error, dict) and isinstance(parsed, dict) and "message" in parsed:
        error = parsed
    if not isinstance(error, dict):
        error = {}
    param = error.get("param")
    code = error.get("code")
    return {
        "message": str(error.get("message") or f"upstream answered {status}"),
        "type": str(error.get("type") or "upstream_error"),
        "param": param if isinstance(param, str) else None,
        "code": code if isinstance(code, str | int) and not isinstance(code, bool) else status,
    }


async def unless_gone(watch: RequestWatch, work: Awaitable[Reply]) -> Reply | None:
    """``work``'s reply, or None when the client disconnects first (``work`` is cancelled,
    which takes the caller out of its batch)."""
    watch.watch_now()  # a batch waits its window: watch from the start
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.gone or not watch.uncancel():
            raise
        return None
    finally:
        watch.close()  # never cancel once the reply is in


async def respond(send: Send, reply: Reply) -> None:
    headers = list(reply.headers)
    if reply.body is not None:
        await send_json(send, reply.status, reply.body, headers)
    else:
        await json_error(
            send, reply.status, reply.message, reply.kind, param=reply.param, headers=headers
        )
