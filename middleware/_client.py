"""The in-app client: ``request.state.promptlb.chat(...)`` routes, retries and degrades exactly
like proxied traffic, without an HTTP hop to ourselves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from ._answer import Answer, answer_headers, node_headers
from ._balancer import Upstream
from ._degrade import Dispatcher
from ._refusals import Refusal, error_body
from ._replies import Body, carries_error, keep, parsed_body, recorder_for
from ._request import RequestReader
from ._sse import StreamAssembler, marks_error, replay_sse, wants_usage

__all__ = ["PromptLBClient", "PromptLBError", "Reply", "ReplyStream"]


class PromptLBError(Exception):
    """No answer: a node answered with an error (``status``, the node's ``body`` and name),
    or promptlb refused (``node`` None, ``body`` the error body the proxy would send).
    ``headers`` (lower-case names) are those the proxy would send with it: the node's own
    (its ``retry-after`` on a 429 or 503) and the ``x-promptlb-*`` ones, or promptlb's
    ``retry-after`` and ``x-promptlb-attempts`` for its refusals (the app had no retry hint,
    where an HTTP client had one)."""

    def __init__(
        self, status: int, body: object, node: str | None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(f"{status} from {node or 'promptlb'}: {body}")
        self.status = status
        self.body = body
        self.node = node
        self.headers = headers or {}


class Reply(dict[str, Any]):
    """An answer's body, as a dict, with ``headers``: the ``x-promptlb-*`` headers the proxy
    sends with it (``-node``, ``-model``, ``-attempts``, and ``-degraded: fallback|cache`` or
    ``-cache: hit``), so that app code tells a lighter model's or a stored answer (up to the
    cache's ``stale_ttl`` old) from a fresh one, as an HTTP client can."""

    __slots__ = ("headers",)

    def __init__(self, body: dict[str, Any], headers: dict[str, str]) -> None:
        super().__init__(body)
        self.headers = headers


class ReplyStream:
    """A stream's events (dicts), with ``headers`` as `Reply` has them, filled in once the
    answer is found (by the first event). ``aclose()`` lets the node go when left early."""

    __slots__ = ("_events", "headers")

    def __init__(self, events: AsyncGenerator[dict[str, Any], None], headers: dict[str, str]):
        self._events = events
        self.headers = headers

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await anext(self._events)

    async def aclose(self) -> None:
        await self._events.aclose()


def _headers(answer: Answer) -> dict[str, str]:
    return _text(answer_headers(answer))


def _text(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}


# A node's headers that describe its body: not those of an error made here in its place.
_BODY_HEADERS = frozenset({"content-length", "content-type", "content-encoding"})


def _node_error(
    status: int, body: object, answer: Answer, up: Upstream, *, made_here: bool = False
) -> PromptLBError:
    """A node's error, with the headers the proxy passes on with it: all of them with the
    node's own body, or, with a body ``made_here`` (an answer that broke off, a stream's
    error), all but those of the node's body (a broken answer's Content-Length of 1,000; told
    by the status, a node's own 502 that broke off kept them)."""
    headers = _text(node_headers(up.response) + answer_headers(answer))
    if made_here:
        headers = {k: v for k, v in headers.items() if k not in _BODY_HEADERS}
    return PromptLBError(status, body, up.node.name, headers)


class PromptLBClient:
    def __init__(
        self,
        dispatcher: Dispatcher,
        reader: RequestReader,
        reload: Callable[..., Awaitable[bool]] | None = None,
    ) -> None:
        self._dispatch = dispatcher
        self._reader = reader
        self._reload = reload

    def use(self, dispatcher: Dispatcher, reader: RequestReader) -> None:
        """A reloaded config: calls from now on go through its dispatcher (a call under way
        keeps the one it started with)."""
        self._dispatch = dispatcher
        self._reader = reader

    async def reload(self, config: Any = None) -> bool:
        """`PromptLBMiddleware.reload`, for app code that reaches the middleware only through
        ``request.state.promptlb`` (``app.add_middleware`` builds it out of reach)."""
        if self._reload is None:
            raise RuntimeError("this client belongs to no middleware that can reload")
        return await self._reload(config)

    async def chat(self, *, model: str, messages: list[dict[str, Any]], **params: Any) -> Reply:
        return await self._call(
            "/v1/chat/completions", {"model": model, "messages": messages, **params}
        )

    async def completions(self, *, model: str, prompt: str | list[str], **params: Any) -> Reply:
        return await self._call("/v1/completions", {"model": model, "prompt": prompt, **params})

    async def embeddings(self, *, model: str, input: str | list[str], **params: Any) -> Reply:
        return await self._call("/v1/embeddings", {"model": model, "input": input, **params})

    def chat_stream(
        self, *, model: str, messages: list[dict[str, Any]], **params: Any
    ) -> ReplyStream:
        body = {"model": model, "messages": messages, **params, "stream": True}
        headers: dict[str, str] = {}
        return ReplyStream(self._stream("/v1/chat/completions", body, headers), headers)

    def completions_stream(
        self, *, model: str, prompt: str | list[str], **params: Any
    ) -> ReplyStream:
        body = {"model": model, "prompt": prompt, **params, "stream": True}
        headers: dict[str, str] = {}
        return ReplyStream(self._stream("/v1/completions", body, headers), headers)

    @asynccontextmanager
    async def _open(
        self, dispatch: Dispatcher, path: str, body: dict[str, Any]
    ) -> AsyncIterator[Answer]:
        """``dispatch``'s answer (fallbacks and cache included), with its refusals as
        `PromptLBError`: one type to catch."""
        try:
            request = self._reader.build(path, body)
            async with dispatch.answer(request) as answer:
                yield answer
        except Refusal as exc:
            headers = _text(exc.headers(dispatch.retry_after))
            headers.pop("connection", None)  # the proxy's connection, not the app's business
            raise PromptLBError(exc.status, exc.error(), None, headers) from None

    # A node's own answer that we turn into an error is raised after the answer's block, not
    # in it: an exception inside is the caller giving up (not counted against the node), and
    # the proxy settles the same answers by their status. In-app traffic never charged a
    # failing node, so it was never ejected nor avoided.

    async def _call(self, path: str, body: dict[str, Any]) -> Reply:
        dispatch = self._dispatch  # a reload meanwhile: the call keeps the one it started with
        async with self._open(dispatch, path, body) as answer:
            up = answer.upstream
            if up is None:
                assert answer.entry is not None
                parsed = parsed_body(answer.entry.body)
                if isinstance(parsed, dict):
                    return Reply(parsed, _headers(answer))
                # Stored from a node that answered this route in text (the proxy replays it).
                error = PromptLBError(502, parsed, "cache", _headers(answer))
            else:
                data = await _rest(answer, up)
                parsed = parsed_body(data) if data else None
                if up.response.status >= 400:
                    error = _node_error(up.response.status, parsed, answer, up)
                elif not isinstance(parsed, dict) or carries_error(parsed):
                    # No answer: a 200 that carries an error is one to the app too, as the
                    # batcher has it (it was handed back as the answer).
                    error = _node_error(502, parsed, answer, up)
                else:
                    # Into the cache as the proxy keeps it: an app that only called in-app
                    # never filled it, and had no fresh hits and no answer for an outage.
                    recorder = recorder_for(answer, path, False, dispatch.entry_limit)
                    if recorder is not None:
                        recorder.feed(data)
                    keep(dispatch.store, answer, recorder)
                    return Reply(parsed, _headers(answer))
        raise error

    async def _stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncGenerator[dict[str, Any], None]:
        dispatch = self._dispatch
        async with self._open(dispatch, path, body) as answer:
            headers.update(_headers(answer))
            up = answer.upstream
            if up is None:
                assert answer.entry is not None
                for event in _events(replay_sse(path, answer.entry, wants_usage(body))):
                    yield event
                return
            status = up.response.status
            if status < 400 and up.response.content_type != "application/json":
                recorder = recorder_for(answer, path, True, dispatch.entry_limit)
                chunks = _chunks(answer, up)
                async for event in _aevents(_fed(chunks, recorder), answer, up):
                    yield event
                keep(dispatch.store, answer, recorder)  # not reached if left early
                return
            # An error, or a 200 that is no stream (a node that ignored `stream`, an error
            # body sent as 200): it ended the iteration with no event and no error.
            data = await _rest(answer, up)
            error = _node_error(status if status >= 400 else 502, parsed_body(data), answer, up)
        raise error


async def _rest(answer: Answer, up: Upstream) -> bytes:
    """The whole answer, held to its deadline as on the proxy's path; broken off, the node's
    failure."""
    try:
        async with asyncio.timeout_at(up.deadline):
            return answer.first + await up.response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _broke(answer, up, exc) from None


def _broke(answer: Answer, up: Upstream, exc: BaseException) -> PromptLBError:
    """The node's answer broke off or ran past the deadline: its failure, as the proxy tells
    it, with the headers the proxy had sent before it broke."""
    status, why = up.broke(exc)
    body = error_body(status, f"upstream answer {why}", "upstream_error")
    return _node_error(status, body, answer, up, made_here=True)


async def _chunks(answer: Answer, up: Upstream) -> AsyncIterator[bytes]:
    yield answer.first
    rest = up.response.content.iter_any()
    while True:
        try:
            # Each read under the deadline, not the whole loop: a timeout around a yield would
            # cancel whatever the caller awaits between two events.
            async with asyncio.timeout_at(up.deadline):
                chunk = await anext(rest)
        except StopAsyncIteration:
            return
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _broke(answer, up, exc) from None
        yield chunk


async def _fed(
    chunks: AsyncIterator[bytes], recorder: StreamAssembler | Body | None
) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        if recorder is not None:
            recorder.feed(chunk)
        yield chunk


def _events(chunks: list[bytes]) -> Iterator[dict[str, Any]]:
    """A cached answer's replay, read as a node's stream is (`_event`)."""
    for chunk in chunks:
        for line in chunk.splitlines():
            event = _event(line, "cache")
            if event is _DONE:
                return
            if event is not None:
                yield event


async def _aevents(
    chunks: AsyncIterator[bytes], answer: Answer, up: Upstream
) -> AsyncIterator[dict[str, Any]]:
    """SSE: events are separated by blank lines; "data: [DONE]" ends the stream. An error
    event (a node's, or the one the proxy writes when a stream breaks) is raised, and so is
    a stream that stops before its end: both were iterated as if the answer were whole. Each
    is the node's failure (``failed``): raised inside the answer's block, it would otherwise
    read as the app giving up, and a node that kept failing so was never charged. Each
    carries the headers the proxy had sent (it carried none)."""
    try:
        async for event in _events_of(chunks, up.node.name):
            yield event
    except PromptLBError as exc:
        up.failed = True
        if not exc.headers:
            exc.headers = _node_error(exc.status, exc.body, answer, up, made_here=True).headers
        raise


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The stream's lines, a last one with no newline after it included."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line
    yield pending


async def _events_of(chunks: AsyncIterator[bytes], node: str) -> AsyncIterator[dict[str, Any]]:
    finished = False  # a choice said why it ended: a server that sends no [DONE] is done
    async for line in _lines(chunks):
        event = _event(line, node)
        if event is _DONE:
            return
        if event is not None:
            finished = _finished(event) or finished
            yield event
    if not finished:
        body = error_body(502, "upstream stream ended before its end", "upstream_error")
        raise PromptLBError(502, body, node)


_DONE: dict[str, Any] = {}


def _event(line: bytes, node: str) -> dict[str, Any] | None:
    """One SSE line's event: None for a line that carries none, `_DONE` for the end."""
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return _DONE
    try:
        event = json.loads(data)
    except ValueError:
        body = error_body(502, "upstream sent an event that is not JSON", "upstream_error")
        raise PromptLBError(502, body, node) from None
    if not isinstance(event, dict):
        body = error_body(502, "upstream sent an event that is not an object", "upstream_error")
        raise PromptLBError(502, body, node)
    # A null "error" (the Responses API's objects carry one) is no error: it ended a good
    # stream with a 502 and charged the node, which the proxy passed through.
    if marks_error(event):
        raise PromptLBError(502, event, node)
    return event


def _finished(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    return isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") for c in choices
    )
