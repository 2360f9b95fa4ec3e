"""Answers the proxy writes itself: a cached answer (as stored or replayed as SSE), and the
bounded copy of a non-stream answer kept for the cache while it passes through."""

from __future__ import annotations

from ._answer import Answer, answer_headers
from ._asgi import Send
from ._sse import replay_sse

__all__ = ["SSE", "Body", "send_cached"]

SSE = b"text/event-stream"


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
