"""The request hot path, in raw ASGI: read, parse, route, forward, stream back."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from ._asgi import DisconnectWatch, Receive, Scope, Send, json_error, send_json
from ._balancer import HOP_BY_HOP, Balancer, UnknownModel, UpstreamError
from ._batch import Batcher, batch_key, string_inputs
from ._batch_io import respond, unless_gone, upstream
from ._cache import CacheEntry
from ._degrade import Answer, Dispatcher, Exhausted
from ._replies import SSE, Body, send_cached
from ._shedding import Shed
from ._sse import StreamAssembler
from ._strategies import NoNodeAvailable
from ._view import Priority, RouteRequest

__all__ = ["Proxy", "models_response", "route_request"]


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


_MAX_TOKENS = 10_000_000  # beyond any context window: a value over it is not a length


def _plausible(max_tokens: object) -> bool:
    """A ``max_tokens`` routing may believe (the node still gets the body as sent)."""
    return (
        isinstance(max_tokens, int)
        and not isinstance(max_tokens, bool)
        and 0 < max_tokens <= _MAX_TOKENS
    )


def route_request(
    body: dict[str, Any],
    size: int,
    priority: Priority = "standard",
    prompt_class: str = "",
    session_key: str | None = None,
) -> RouteRequest:
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    return RouteRequest(
        model=body["model"],
        # About four bytes a token: a body-size estimate costs nothing and ranks prompts right.
        input_tokens=size // 4,
        max_tokens=max_tokens if _plausible(max_tokens) else None,
        stream=body.get("stream") is True,
        session_key=session_key,
        priority=priority,
        prompt_class=prompt_class,
    )


class Proxy:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatch = dispatcher
        self._lb = balancer = dispatcher.balancer
        self._limit = balancer.config.max_body_bytes
        self._retry_after = str(max(1, round(balancer.config.health.interval))).encode()
        self._shed_after = str(balancer.config.shedding.retry_after).encode()
        cache = balancer.config.cache
        self._entry_limit = cache.max_entry_bytes if cache is not None else 0
        self._classify = dispatcher.classify
        header = balancer.config.class_header
        self._class_header = header.lower().encode() if header else None
        batching = balancer.config.batching
        self._batcher: Batcher | None = None
        if batching.enabled:
            self._batcher = Batcher(batching.batch_window, batching.max_batch)
        # The client's own key goes upstream only when forwarded: then callers with different
        # keys must never share a request.
        self._keyed_auth = balancer.config.forward_authorization
        self._affinity_key = dispatcher.affinity_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        priority = token = asked_class = None
        no_fallback = False
        class_header = self._class_header
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > self._limit:
                    return await json_error(
                        send, 413, f"request body over {self._limit} bytes", "invalid_request_error"
                    )
            elif name.startswith(b"x-promptlb-"):
                if name == b"x-promptlb-priority":
                    priority = value
                elif name == b"x-promptlb-priority-token":
                    token = value
                elif name == b"x-promptlb-no-fallback":
                    no_fallback = value.strip() in (b"1", b"true", b"yes")
            if name == class_header:
                asked_class = value.decode("latin-1").strip()
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
        rank: Priority = "standard"
        if priority is not None:
            rank = self._lb.admission.priority(priority, token, scope.get("client"))
        prompt_class = ""
        if asked_class:
            prompt_class = asked_class
        elif self._classify is not None:
            prompt_class = self._classify(body)
        session_key = None
        keys = self._affinity_key
        if keys is not None:  # off by default: then not even the headers are read again
            session_key = keys(body, keys.header_value(scope["headers"]))
        request = route_request(body, len(raw), rank, prompt_class, session_key)
        if self._batcher is not None and scope["path"].endswith("/embeddings"):
            return await self._batched(scope, receive, send, request, body, raw, no_fallback)
        await self.forward(scope, receive, send, request, body, raw, no_fallback)
        return None

    async def _batched(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        request: RouteRequest,
        body: dict[str, Any],
        raw: bytes,
        no_fallback: bool,
    ) -> None:
        batcher = self._batcher
        assert batcher is not None
        inputs = string_inputs(body)
        if inputs is None or len(inputs) > batcher.max_batch or scope.get("query_string"):
            return await self.forward(scope, receive, send, request, body, raw, no_fallback)
        headers = scope["headers"]
        auth = None
        if self._keyed_auth:
            auth = next((v for k, v in headers if k == b"authorization"), None)
        key = batch_key(
            scope["path"], body, request.priority, request.prompt_class, no_fallback, auth
        )
        fetch = upstream(
            self._dispatch,
            request,
            scope["path"],
            headers,
            no_fallback=no_fallback,
            retry_after=self._retry_after,
            shed_after=self._shed_after,
        )
        reply = await unless_gone(receive, batcher.submit(key, body, inputs, fetch))
        if reply is not None:
            await respond(send, reply)
        return None

    async def forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        request: RouteRequest,
        body: dict[str, Any],
        raw: bytes,
        no_fallback: bool = False,
    ) -> None:
        # A client that goes away cancels this task, so the upstream try is cancelled too and
        # the balancer's bookkeeping (in-flight, results) unwinds exactly.
        watch = DisconnectWatch(receive)
        path = scope["path"] + (
            ("?" + scope["query_string"].decode("latin-1")) if scope.get("query_string") else ""
        )
        started = False
        try:
            async with self._dispatch.answer(
                request, path, body, raw, scope["headers"], no_fallback=no_fallback
            ) as answer:
                started = True
                if answer.upstream is None:
                    await send_cached(send, scope["path"], request.stream, answer)
                else:
                    await self._pass_on(send, scope["path"], answer)
            watch.armed = False
        except asyncio.CancelledError:
            watch.armed = False
            if not watch.gone:
                raise
            watch.uncancel()
        except UnknownModel as exc:
            watch.armed = False
            await json_error(
                send,
                404,
                f"The model `{exc.model}` does not exist.",
                "model_not_found",
                param="model",
            )
        except NoNodeAvailable as exc:
            watch.armed = False
            await json_error(
                send,
                503,
                str(exc),
                "service_unavailable",
                headers=[(b"retry-after", self._retry_after)],
            )
        except Shed as exc:
            watch.armed = False
            self._lb.metrics.shed.labels(request.priority).inc()
            await json_error(
                send,
                429,
                str(exc),
                "rate_limit_error",
                headers=[(b"retry-after", self._shed_after)],
            )
        except (UpstreamError, Exhausted) as exc:
            watch.armed = False
            if started:
                raise
            status, kind = (
                (exc.status, "upstream_error")
                if isinstance(exc, UpstreamError)
                else (
                    503,
                    "service_unavailable",
                )
            )
            await json_error(
                send,
                status,
                str(exc),
                kind,
                headers=[
                    (b"x-promptlb-attempts", str(exc.attempts).encode()),
                    (b"retry-after", self._retry_after),
                ],
            )
        finally:
            watch.close()

    async def _pass_on(self, send: Send, path: str, answer: Answer) -> None:
        up = answer.upstream
        assert up is not None
        response = up.response
        headers = [
            (k, v)
            for k, v in response.raw_headers
            if k.lower().decode("latin-1") not in HOP_BY_HOP or k.lower() == b"content-length"
        ]
        headers += [
            (b"x-promptlb-node", up.node.name.encode()),
            (b"x-promptlb-model", answer.model.encode()),
            (b"x-promptlb-attempts", str(answer.attempts).encode()),
        ]
        if answer.degraded is not None:
            headers.append((b"x-promptlb-degraded", answer.degraded.encode()))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        sse = response.headers.get("content-type", "").encode().startswith(SSE)
        recorder: StreamAssembler | Body | None = None
        if answer.store_key is not None:
            limit = self._entry_limit
            recorder = StreamAssembler(path.endswith("/chat/completions"), max_bytes=limit)
            if not sse:
                recorder = Body(limit)
        if answer.first:
            if recorder is not None:
                recorder.feed(answer.first)
            await send({"type": "http.response.body", "body": answer.first, "more_body": True})
        try:
            async with asyncio.timeout_at(up.deadline):
                async for chunk in response.content.iter_any():
                    if recorder is not None:
                        recorder.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
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
        if recorder is not None and not up.failed and answer.store_key is not None:
            complete = recorder.result()
            if complete is not None:
                self._dispatch.store(
                    answer.store_key,
                    CacheEntry(body=complete, model=answer.model, created=time.time()),
                )


async def models_response(lb: Balancer, send: Send) -> None:
    created = int(time.time())
    data = [
        {"id": m, "object": "model", "created": created, "owned_by": "promptlb"}
        for m in lb.table.ready_models()
    ]
    await send_json(send, 200, {"object": "list", "data": data})
