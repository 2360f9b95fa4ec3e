"""What the dispatcher hands over once an answer is found, and the headers that say how it was
made: written by one function for the proxy, the batcher and the in-app client alike."""

from __future__ import annotations

from dataclasses import dataclass

from ._balancer import Try, Upstream
from ._cache import CacheEntry

__all__ = ["ANSWER_HEADERS", "Answer", "answer_headers"]


@dataclass(slots=True)
class Answer:
    """What to pass on: a node's response (its first chunk already read) or a cached answer."""

    model: str  # the model that answers
    upstream: Upstream | None = None
    first: bytes = b""
    entry: CacheEntry | None = None
    degraded: str | None = None  # "fallback" | "cache"
    attempts: int = 0
    store_key: str | None = None  # cache the answer under this key once it is complete
    held: Try | None = None  # open until passed on


# Every header `answer_headers` may write.
ANSWER_HEADERS = (
    b"x-promptlb-node",
    b"x-promptlb-model",
    b"x-promptlb-attempts",
    b"x-promptlb-degraded",
    b"x-promptlb-cache",
)


def answer_headers(answer: Answer) -> list[tuple[bytes, bytes]]:
    """``x-promptlb-node`` (``cache`` for a stored answer), ``-model``, ``-attempts``, and
    ``-degraded`` for a fallback or cache hop, or ``-cache: hit`` for a fresh cached answer."""
    up = answer.upstream
    headers = [
        (b"x-promptlb-node", b"cache" if up is None else up.node.name.encode()),
        (b"x-promptlb-model", answer.model.encode()),
        (b"x-promptlb-attempts", str(answer.attempts).encode()),
    ]
    if answer.degraded is not None:
        headers.append((b"x-promptlb-degraded", answer.degraded.encode()))
    elif up is None:
        headers.append((b"x-promptlb-cache", b"hit"))
    return headers
