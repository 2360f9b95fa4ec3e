"""The request hot path, in raw ASGI: read, parse, route, forward, stream back."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from ._asgi import Receive, Scope, Send, json_error, send_json
from ._balancer import HOP_BY_HOP, Balancer, UnknownModel, UpstreamError
from ._strategies import NoNodeAvailable
from ._view import RouteRequest

__all__ = ["Proxy"]

_SSE = b"text/event-stream"


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def route_request(body: dict[str, Any], size: int) -> RouteRequest:
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    return RouteRequest(
        model=body["model"],
        # About four bytes a token: a body-size estimate costs nothing and ranks prompts right.
        input_tokens=size // 4,
        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        stream=body.get("stream") is True,
        session_key=body.get("user") if isinstance(body.get("user"), str) else None,
    )


class Proxy:
    def __init__(self, balancer: Balancer) -> None:
        self._lb = balancer
        self._limit = balancer.config.max_body_bytes
        self._retry_after = str(max(1, round(balancer.config.health.interval)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self._limit:
                return await json_error(
                    send, 413, f"request body over {self._limit} bytes", "invalid_request_error"
                )
        try:
            raw = await _read_body(receive, self._limit)
        except _TooLarge:
            return await json_error(
                send, 413, f"request body over {self._limit} bytes", "invalid_request_error"
            )
        except _ClientGone:
            return None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return await json_error(
                send, 400, "request body is not valid JSON", "invalid_request_error"
            )
        if not isinstance(body, dict):
            return await json_error(
                send, 400, "request body must be a JSON object", "invalid_request_error"
            )
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return await json_error(
                send, 400, "`model` is required", "invalid_request_error", param="model"
            )
        request = route_request(body, len(raw))
        await self.forward(scope, receive, send, request, raw)
        return None

    async def forward(
        self, scope: Scope, receive: Receive, send: Send, request: RouteRequest, raw: bytes
    ) -> None:
        # A client that goes away cancels this task, so the upstream try is cancelled too and
        # the balancer's bookkeeping (in-flight, results) unwinds exactly.
        task = asyncio.current_task()
        assert task is not None
        gone = False
        upstream_phase = True  # cancel only while awaiting the node, never once we are done

        def on_message(future: asyncio.Future[Any]) -> None:
            nonlocal gone
            if (
                upstream_phase
                and not future.cancelled()
                and future.exception() is None
                and future.result()["type"] == "http.disconnect"
            ):
                gone = True
                task.cancel()

        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(on_message)
        started = False
        path = scope["path"] + (
            ("?" + scope["query_string"].decode("latin-1")) if scope.get("query_string") else ""
        )
        try:
            async with self._lb.open(request, path, raw, scope["headers"]) as up:
                response = up.response
                headers = [
                    (k, v)
                    for k, v in response.raw_headers
                    if k.lower().decode("latin-1") not in HOP_BY_HOP
                    or k.lower() == b"content-length"
                ]
                headers += [
                    (b"x-promptlb-node", up.node.name.encode()),
                    (b"x-promptlb-model", request.model.encode()),
                    (b"x-promptlb-attempts", str(up.attempts).encode()),
                ]
                await send(
                    {"type": "http.response.start", "status": response.status, "headers": headers}
                )
                started = True
                sse = response.headers.get("content-type", "").encode().startswith(_SSE)
                try:
                    async with asyncio.timeout_at(up.deadline):
                        async for chunk in response.content.iter_any():
                            if up.first_byte_at is None:
                                up.first_byte_at = time.monotonic()
                            await send(
                                {"type": "http.response.body", "body": chunk, "more_body": True}
                            )
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # After the first byte nothing is retried: end the stream, say why.
                    up.failed = True
                    if sse:
                        event = {
                            "error": {
                                "message": f"upstream stream broke: {exc!r}",
                                "type": "upstream_error",
                                "code": 502,
                            }
                        }
                        await send(
                            {
                                "type": "http.response.body",
                                "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                                "more_body": True,
                            }
                        )
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            upstream_phase = False
        except asyncio.CancelledError:
            upstream_phase = False
            if not gone:
                raise
            task.uncancel()  # our own cancel, for the client that left: nothing left to answer
        except UnknownModel as exc:
            upstream_phase = False
            await json_error(
                send,
                404,
                f"The model `{exc.model}` does not exist.",
                "model_not_found",
                param="model",
            )
        except NoNodeAvailable as exc:
            upstream_phase = False
            await json_error(
                send,
                503,
                str(exc),
                "service_unavailable",
                headers=[(b"retry-after", self._retry_after.encode())],
            )
        except UpstreamError as exc:
            upstream_phase = False
            if started:
                raise
            await json_error(
                send,
                exc.status,
                str(exc),
                "upstream_error",
                headers=[
                    (b"x-promptlb-attempts", str(exc.attempts).encode()),
                    (b"retry-after", self._retry_after.encode()),
                ],
            )
        finally:
            upstream_phase = False
            if not watcher.done():
                watcher.remove_done_callback(on_message)
                watcher.cancel()


async def models_response(lb: Balancer, send: Send) -> None:
    created = int(time.time())
    data = [
        {"id": m, "object": "model", "created": created, "owned_by": "promptlb"}
        for m in lb.table.ready_models()
    ]
    await send_json(send, 200, {"object": "list", "data": data})
