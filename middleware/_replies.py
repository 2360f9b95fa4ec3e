"""Answers the proxy writes itself: a cached answer (as stored or replayed as SSE), and the
bounded copy of a non-stream answer kept for the cache while it passes through."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

from ._answer import Answer, answer_headers
from ._asgi import Send
from ._cache import CacheEntry
from ._sse import CUT, StreamAssembler, marks_error, replay_sse

__all__ = ["SSE", "Body", "carries_error", "keep", "parsed_body", "recorder_for", "send_cached"]

SSE = b"text/event-stream"
# A body's finish reasons, read off its bytes (the body is parsed only when it may be an error).
_REASON = re.compile(rb'"finish_reason"\s*:\s*"([^"]*)"')
_CUT = frozenset(reason.encode() for reason in CUT)


class Body:
    """A non-stream answer, kept for the cache while it passes through (up to ``limit``)."""

    __slots__ = ("chunks", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.chunks: list[bytes] | None = []
        self.limit = limit
        self.size = 0

    def feed(self, chunk: bytes) -> None:
        if self.chunks is None:
            return
        self.size += len(chunk)
        if self.size > self.limit:
            self.chunks = None
        else:
            self.chunks.append(chunk)

    def result(self) -> bytes | None:
        return None if self.chunks is None else b"".join(self.chunks)


def recorder_for(answer: Answer, path: str, sse: bool, limit: int) -> StreamAssembler | Body | None:
    """What keeps ``answer`` for the cache while it passes (up to ``limit`` bytes), or None
    when it is not to be kept: no store key, or compressed by the node (the cache would serve
    its bytes as plain JSON to a client that asked for none). The proxy's and the in-app
    client's, so that both fill the cache alike."""
    up = answer.upstream
    if answer.store_key is None or up is None:
        return None
    headers = up.response.headers
    if headers.get("content-encoding"):
        return None
    if (
        up.response.content_length is None
        and "chunked" not in headers.get("transfer-encoding", "").lower()
    ):
        # Ended by the connection's close (HTTP/1.0, some proxies): a node dying mid-answer
        # looks like its end, and the cut answer was kept and served as a hit for a day.
        return None
    if sse:
        return StreamAssembler(path.endswith("/chat/completions"), max_bytes=limit)
    return Body(limit)


def carries_error(parsed: object) -> bool:
    """Whether a node's 200 body is an error rather than an answer: OpenAI's and TEI's
    ``{"error": ...}`` or vLLM's older ``{"object": "error", ...}``, without the ``choices``
    or ``data`` an answer has."""
    return (
        isinstance(parsed, dict)
        and marks_error(parsed)
        and "choices" not in parsed
        and "data" not in parsed
    )


def keep(
    store: Callable[[str, CacheEntry], None],
    answer: Answer,
    recorder: StreamAssembler | Body | None,
) -> None:
    """``answer``, passed on whole and unbroken, into the cache, with the content type it came
    with (a stream is kept as the JSON answer it assembles to)."""
    up = answer.upstream
    if recorder is None or up is None or up.failed or answer.store_key is None:
        return
    complete = recorder.result()
    if complete is None:
        return
    content_type = "application/json"
    usage = True
    if isinstance(recorder, Body):
        # A 200 carrying an error is no answer to serve again (parsed only when it may be one:
        # inside a JSON string the quotes are escaped, so most answers skip the parse).
        if b'"error"' in complete and carries_error(parsed_body(complete)):
            return
        if any(r in _CUT for r in _REASON.findall(complete)):
            return  # cut by the engine ("abort", "error"): half an answer
        content_type = up.response.headers.get("Content-Type", content_type)
        if not content_type.isascii():
            # aiohttp reads a header's bytes that are no UTF-8 as lone surrogates, which
            # msgpack cannot pack: the write failed, and a Redis backend backed off as if down.
            return
    else:
        usage = recorder.has_usage
    entry = CacheEntry(complete, answer.model, time.time(), content_type, usage)
    store(answer.store_key, entry)


def parsed_body(data: bytes) -> object:
    """A node's body as JSON, or as text where it is none (an error page, a proxy's HTML)."""
    try:
        return json.loads(data)
    except ValueError:
        return data.decode(errors="replace")


async def send_cached(
    send: Send, path: str, stream: bool, answer: Answer, usage: bool = False
) -> None:
    """A cached answer: as it was stored, or replayed as SSE for a client that asked to stream
    (with the usage chunk if it asked for that too: ``usage``)."""
    entry = answer.entry
    assert entry is not None
    headers = answer_headers(answer)
    body = entry.body
    content_type = entry.content_type.encode()
    if stream:
        try:
            body = b"".join(replay_sse(path, entry, usage))
            content_type = SSE
            headers.append((b"cache-control", b"no-cache"))
        except ValueError:
            pass  # not a stream-shaped answer (embeddings): as stored
    headers += [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
