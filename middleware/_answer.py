"""What the dispatcher hands over once an answer is found, and the headers that say how it was
made: written by one function for the proxy, the batcher and the in-app client alike."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from ._balancer import HOP_BY_HOP, Try, Upstream
from ._batch import BATCH_HEADER
from ._cache import CacheEntry

__all__ = ["ANSWER_HEADERS", "NODE_DROPPED", "Answer", "answer_headers", "node_headers"]


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


# Not passed on from the node: hop-by-hop headers (but the length, which the body keeps), the
# node's Date and Server, which the server in front writes for the gateway (Date is a singleton
# field: two of them are a malformed answer), and the headers this gateway writes itself (a
# node that is another promptlb sends its own: each would come twice, with two values, and its
# batch header told a caller this gateway never batched that it was batched with others).
NODE_DROPPED = frozenset(
    name.encode() for name in (HOP_BY_HOP - {"content-length"}) | {"date", "server"}
) | frozenset((*ANSWER_HEADERS, BATCH_HEADER))


def node_headers(
    response: aiohttp.ClientResponse, dropped: frozenset[bytes] = NODE_DROPPED
) -> list[tuple[bytes, bytes]]:
    """The node's headers a caller gets, lower case (ASGI's names: a middleware outside looks
    for b"content-length"; the node may have sent any case), less ``dropped`` and those its
    ``Connection`` header names (RFC 9110 7.6.1: this hop's alone too)."""
    raw = response.raw_headers
    headers = [(n, v) for k, v in raw if (n := k.lower()) not in dropped]
    if "Connection" in response.headers:
        # Read as bytes: the decoded value may hold what latin-1 cannot encode.
        named = {
            t.strip().lower() for k, v in raw if k.lower() == b"connection" for t in v.split(b",")
        } - dropped
        if named:
            headers = [h for h in headers if h[0] not in named]
    return headers
