"""The batcher's I/O: a caller's way upstream through the dispatcher, reading the node's answer
whole, and answering the caller (or noticing that it left)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Iterable
from dataclasses import replace
from typing import Any

import aiohttp

from ._asgi import DisconnectWatch, Receive, Send, json_error, send_json
from ._balancer import UnknownModel, UpstreamError
from ._batch import Fetch, Reply, fail
from ._degrade import Answer, Dispatcher, Exhausted
from ._shedding import Shed
from ._strategies import NoNodeAvailable
from ._view import RouteRequest

__all__ = ["respond", "unless_gone", "upstream"]


def upstream(
    dispatch: Dispatcher,
    request: RouteRequest,
    path: str,
    headers: Iterable[tuple[bytes, bytes]],
    *,
    no_fallback: bool,
    retry_after: bytes,
    shed_after: bytes,
) -> Fetch:
    """A caller's way upstream through the dispatcher, its refusals as `Reply`s (the same
    statuses and headers as the proxy's own answers)."""
    sent = list(headers)

    async def fetch(body: dict[str, Any]) -> Reply:
        raw = json.dumps(body).encode()
        req = replace(request, input_tokens=len(raw) // 4)
        try:
            async with dispatch.answer(req, path, body, raw, sent, no_fallback=no_fallback) as it:
                return await _read(it)
        except UnknownModel as exc:
            message = f"The model `{exc.model}` does not exist."
            return fail(404, message, "model_not_found", param="model")
        except NoNodeAvailable as exc:
            return fail(503, str(exc), "service_unavailable", (b"retry-after", retry_after))
        except Shed as exc:
            dispatch.balancer.metrics.shed.labels(request.priority).inc()
            return fail(429, str(exc), "rate_limit_error", (b"retry-after", shed_after))
        except (UpstreamError, Exhausted) as exc:
            status, kind = (
                (exc.status, "upstream_error")
                if isinstance(exc, UpstreamError)
                else (503, "service_unavailable")
            )
            tries = (b"x-promptlb-attempts", str(exc.attempts).encode())
            return fail(status, str(exc), kind, tries, (b"retry-after", retry_after))

    return fetch


async def _read(answer: Answer) -> Reply:
    """The whole answer, parsed; a node's error as the node worded it."""
    up = answer.upstream
    headers = [
        (b"x-promptlb-node", b"cache" if up is None else up.node.name.encode()),
        (b"x-promptlb-model", answer.model.encode()),
        (b"x-promptlb-attempts", str(answer.attempts).encode()),
    ]
    if answer.degraded is not None:
        headers.append((b"x-promptlb-degraded", answer.degraded.encode()))
    status = 200
    if up is None:
        assert answer.entry is not None
        data = answer.entry.body
    else:
        status = up.response.status
        try:
            async with asyncio.timeout_at(up.deadline):
                data = answer.first + await up.response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            up.failed = True
            code = 504 if isinstance(exc, TimeoutError) else 502
            return fail(code, f"upstream answer broke: {exc!r}", "upstream_error", *headers)
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    if status != 200:
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if not isinstance(error, dict):
            error = {}
        message = str(error.get("message") or f"upstream answered {status}")
        return fail(status, message, str(error.get("type") or "upstream_error"), *headers)
    if not isinstance(parsed, dict):
        return fail(502, "upstream answer is not a JSON object", "upstream_error", *headers)
    return Reply(200, parsed, headers=tuple(headers))


async def unless_gone(receive: Receive, work: Awaitable[Reply]) -> Reply | None:
    """``work``'s reply, or None when the client disconnects first (``work`` is cancelled,
    which takes the caller out of its batch)."""
    watch = DisconnectWatch(receive)
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.gone:
            raise
        watch.uncancel()
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
