"""The request hot path, in raw ASGI: read, parse, route, forward, stream back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp

from ._answer import Answer, answer_headers, node_headers
from ._asgi import Receive, RequestWatch, Scope, Send, send_json, send_refusal
from ._balancer import Balancer
from ._batch import Batcher, batch_key, string_inputs
from ._batch_io import respond, unless_gone, upstream
from ._config import Config
from ._degrade import Dispatcher
from ._refusals import Refusal, SlowBody
from ._replies import SSE, Body, keep, recorder_for, send_cached
from ._request import Request, RequestReader
from ._sse import StreamAssembler, wants_usage

__all__ = ["Proxy", "models_response"]

_SSE_TEXT = SSE.decode()

_log = logging.getLogger("promptlb.middleware")
# A broken stream's closing error event waits this long for a client to take it: one that has
# stopped reading would otherwise hold the request open for as long as it stays connected.
_TRAILER_S = 5.0


class Proxy:
    """The balanced routes: read the request, find its answer, pass it on (streaming)."""

    def __init__(self, dispatcher: Dispatcher, reader: RequestReader, config: Config) -> None:
        self._dispatch = dispatcher
        self._reader = reader
        self._retry_after = dispatcher.retry_after
        self._alarms = dispatcher.balancer.alarms
        self._body_timeout = config.requests.body_timeout
        self._entry_limit = dispatcher.entry_limit
        batching = config.batching
        self._batcher: Batcher | None = None
        if batching.enabled:
            self._batcher = Batcher(batching.batch_window, batching.max_batch)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = RequestWatch(receive, self._body_timeout, alarms=self._alarms)
        try:
            try:
                request = await self._reader.read(scope, receive)
            except asyncio.CancelledError:
                if not watch.slow or not watch.uncancel():
                    raise
                return await send_refusal(send, SlowBody(self._body_timeout), self._retry_after)
            except Refusal as exc:
                watch.close()  # no deadline runs out while it is told
                return await send_refusal(send, exc, self._retry_after)
            if request is None:
                return None  # the client left while sending
            watch.body_read()
            if self._batcher is not None and request.path.endswith("/embeddings"):
                return await self._batched(receive, send, request, watch)
            await self.forward(send, request, watch)
        finally:
            watch.close()
        return None

    async def _batched(
        self, receive: Receive, send: Send, request: Request, watch: RequestWatch
    ) -> None:
        batcher = self._batcher
        assert batcher is not None
        inputs = string_inputs(request.body)
        if inputs is None or len(inputs) > batcher.max_batch or request.target != request.path:
            return await self.forward(send, request, watch)
        # A caller's inputs must not travel (and be billed) under another's key or organisation.
        caller = request.caller(self._dispatch.caller_names)
        route = request.route
        key = batch_key(
            request.path,
            request.body,
            route.priority,
            route.prompt_class,
            request.no_fallback,
            caller,
        )
        fetch = upstream(self._dispatch, request)
        reply = await unless_gone(watch, batcher.submit(key, dict(request.body), inputs, fetch))
        if reply is not None:
            await respond(send, reply)
        return None

    async def forward(self, send: Send, request: Request, watch: RequestWatch) -> None:
        # A client that goes away cancels this task, so the upstream try is cancelled too and
        # the balancer's bookkeeping (in-flight, results) unwinds exactly.
        started = False
        try:
            async with self._dispatch.answer(request) as answer:
                started = True
                if answer.upstream is None:
                    await send_cached(
                        send, request.path, request.route.stream, answer, wants_usage(request.body)
                    )
                else:
                    await self._pass_on(send, request.path, answer)
            watch.armed = False
        except asyncio.CancelledError:
            watch.armed = False
            if not watch.gone or not watch.uncancel():
                raise
        except Refusal as exc:
            watch.armed = False
            if started:
                raise
            await send_refusal(send, exc, self._retry_after)

    async def _pass_on(self, send: Send, path: str, answer: Answer) -> None:
        up = answer.upstream
        assert up is not None
        response = up.response
        headers = node_headers(response)
        headers += answer_headers(answer)
        try:
            await send(
                {"type": "http.response.start", "status": response.status, "headers": headers}
            )
        except OSError:
            raise  # the client's connection
        except Exception:
            # The server refused the node's headers (uvicorn: a control character in a value),
            # having marked the response started: nothing more can be sent, and the node's
            # answer is at fault. Charged to it, outlier ejection moves traffic off a node that
            # answers so; checking every value here instead cost each request a microsecond.
            up.failed = True
            raise
        # Compared as text: aiohttp decodes a non-UTF-8 byte in a header to a lone surrogate,
        # and encoding that raised after the headers were sent (no body, the connection cut).
        sse = response.headers.get("content-type", "").startswith(_SSE_TEXT)
        recorder = recorder_for(answer, path, sse, self._entry_limit)
        if recorder is not None and answer.first:
            recorder.feed(answer.first)
        if response.content.at_eof():
            # The whole answer came with its first chunk (most short, non-stream ones): one
            # write, and no timer for a body that is already in.
            await send({"type": "http.response.body", "body": answer.first})
        else:
            await self._stream_rest(send, answer, recorder, sse)
        keep(self._dispatch.store, answer, recorder)

    async def _stream_rest(
        self, send: Send, answer: Answer, recorder: StreamAssembler | Body | None, sse: bool
    ) -> None:
        up = answer.upstream
        assert up is not None
        response = up.response
        # An event's start is held until its end comes: a node that breaks off inside an event
        # then leaves none half-sent, and the error event that follows is the client's to read
        # (after half an event, the openai client failed on the JSON instead). Chunks of whole
        # events, nearly all, pass at once.
        held = b""
        first = answer.first
        # (Not in compressed bytes, whose blank lines are no event's end.)
        sse = sse and not response.headers.get("content-encoding")
        if sse and first:
            first, held = _whole_events(first)
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
        # The deadline may pass while a slow client holds a send back: the time spent in sends
        # tells whether the client, not the node, took most of it.
        clock = asyncio.get_running_loop().time
        begun = clock()
        blocked = 0.0
        sending: float | None = None  # when the send under way began
        last = first or b"\n\n"  # the bytes passed on last (none: the body's start)
        try:
            async with asyncio.timeout_at(up.deadline):
                async for chunk in response.content.iter_any():
                    if recorder is not None:
                        recorder.feed(chunk)
                    if sse:
                        chunk, held = _whole_events(chunk, held)
                        if not chunk:
                            continue
                    sending = clock()
                    last = chunk
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    blocked += clock() - sending
                    sending = None
        except (aiohttp.ClientError, TimeoutError) as exc:
            # After the first byte nothing is retried: end the stream, say why (not how: the
            # exception may name the node's address, which is for the log).
            code, why = up.broke(exc)
            if up.overran and sending is not None:
                now = clock()
                up.client_slow = blocked + (now - sending) > (now - begun) / 2
            _log.debug("stream from node %s broke: %r", up.node.name, exc)
            if answer.held is not None:
                # Settled before anything more is written: a client that has stopped reading
                # holds the sends below, and the node's slot and connection with them.
                answer.held.close(exc)
            if not sse or response.content_length is not None:
                # A body cut short must not end as if whole (a short JSON, a length the server
                # would refuse): the connection closes on it instead. So does a compressed
                # stream (no longer `sse` here): a plain-text trailer inside its gzip broke the
                # client's decoding.
                return
            event = {
                "error": {
                    "message": f"upstream stream {why}",
                    "type": "upstream_error",
                    "code": code,
                }
            }
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            if not last.endswith((b"\n\n", b"\r\n\r\n")):
                data = b"\n\n" + data  # the node stopped inside an event: the error its own
            # A client that takes nothing in that time: the connection closes on it.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_TRAILER_S):
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send({"type": "http.response.body", "body": held, "more_body": False})


# Held back no further: past this, an event without its end (a node that never ends one) is
# passed on as it comes, as before.
_HELD_MAX = 64 * 1024


def _whole_events(chunk: bytes, held: bytes = b"") -> tuple[bytes, bytes]:
    """``held + chunk`` split after its last whole SSE event: what may go now, and what waits.
    Only the chunk (and the end of what was held) is searched: a stream that ends no event
    would otherwise rescan its held bytes with every chunk."""
    data = held + chunk if held else chunk
    if data.endswith(b"\n\n") or len(data) > _HELD_MAX:
        return data, b""
    start = max(0, len(held) - 3)
    end = 0
    for blank in _EVENT_ENDS:  # a blank line, as the spec's line ends make one
        at = data.rfind(blank, start)
        if at >= 0:
            end = max(end, at + len(blank))
    return data[:end], data[end:]


_EVENT_ENDS = (b"\n\n", b"\r\r", b"\r\n\r\n", b"\n\r\n", b"\r\n\r")


async def models_response(lb: Balancer, send: Send) -> None:
    created = int(time.time())
    data = [
        {"id": m, "object": "model", "created": created, "owned_by": "promptlb"}
        for m in lb.table.ready_models()
    ]
    await send_json(send, 200, {"object": "list", "data": data})
