"""The response cache: keys from normalized requests, complete answers stored in memory or in
Redis (the SSE side, assembling and replaying streams, is in ``_sse``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from ._redis import MAX_CONNECTIONS, connect, refusals

__all__ = [
    "CacheEntry",
    "MemoryCache",
    "RedisCache",
    "ResponseCache",
    "cache_key",
    "open_cache",
    "sampled",
]

# Fields that change how an answer is delivered or billed, not what it says.
_IGNORED = frozenset(
    {"model", "stream", "stream_options", "user", "metadata", "store", "service_tier"}
)
_PROMPT_FIELDS = ("messages", "prompt", "input")


CLOCK_SKEW = 5.0  # seconds between the replicas' clocks that still count as in step


@dataclass(frozen=True, slots=True)
class CacheEntry:
    body: bytes  # the whole answer as a non-stream JSON body
    model: str  # the model that produced it
    created: float  # time.time() when stored
    content_type: str = "application/json"
    # False for an answer assembled from a stream that carried no usage (the client did not ask
    # for it): not served as a whole answer, which has one (`Dispatcher` asks the node instead).
    usage: bool = True

    def fresh(self, now: float, ttl: float) -> bool:
        """Younger than ``ttl`` by the wall clock of the replica that stored it. An entry from
        more than `CLOCK_SKEW` ahead is not fresh: a replica whose clock ran minutes fast had
        its entries served as fresh by every other for that much longer than ``ttl``."""
        age = now - self.created
        return -CLOCK_SKEW <= age <= ttl

    def pack(self) -> bytes:
        fields = {"b": self.body, "m": self.model, "c": self.created, "t": self.content_type}
        if not self.usage:  # left out otherwise: what an older replica stored and reads
            fields["u"] = False
        packed: bytes = msgpack.packb(fields)
        return packed

    @classmethod
    def unpack(cls, data: bytes) -> CacheEntry:
        try:
            raw = msgpack.unpackb(data)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ValueError(f"not a cache entry: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("not a cache entry: not a map")
        body, model, created, kind = raw.get("b"), raw.get("m"), raw.get("c"), raw.get("t")
        if (
            not isinstance(body, bytes)
            or not isinstance(model, str)
            or not isinstance(created, float | int)
            or isinstance(created, bool)
            or not isinstance(kind, str)
        ):
            raise ValueError("not a cache entry: bad fields")
        return cls(body, model, float(created), kind, raw.get("u") is not False)


_EXACT = 2**53  # every integer up to it is a float exactly
_REAL_FIELDS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
)


def cache_key(
    path: str,
    body: Mapping[str, Any],
    model_key: str,
    caller: tuple[bytes | None, ...] = (),
) -> str | None:
    """A hash of what decides the answer (the temperature included, so a sampled request
    matches only its twin), or ``None`` for a body with no prompt or an unusable temperature.

    ``path`` is the target as sent upstream (its query string too). ``caller``: the
    credential headers the nodes see (`Request.caller`), which may answer each key
    differently (or refuse it): an answer is shared only by callers of the same keys."""
    if not any(f in body for f in _PROMPT_FIELDS):
        return None
    temperature = body.get("temperature")
    if temperature is not None and not _finite(temperature):
        return None
    # A null asks what leaving the field out does, and 1 what 1.0 does (for the real-valued
    # sampling fields; not for integers such as a seed, which a float could not tell apart).
    shape = {k: v for k, v in body.items() if k not in _IGNORED and v is not None}
    for name in _REAL_FIELDS:
        value = shape.get(name)
        # Only where a float holds it exactly: a 400-digit top_p raised OverflowError (a 500).
        if isinstance(value, int) and not isinstance(value, bool) and -_EXACT <= value <= _EXACT:
            shape[name] = float(value)
    what: list[Any] = [path, model_key, shape]
    if any(value is not None for value in caller):  # hashed below: the key never shows them
        what.append([None if v is None else v.decode("latin-1") for v in caller])
    try:
        text = json.dumps(what, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def sampled(path: str, body: Mapping[str, Any], default_temperature: float = 1.0) -> bool:
    """Whether the answer is a sample (temperature above 0, OpenAI's default being 1): another
    asking would get another answer, so a stored one stands in for it only when degraded."""
    if path.endswith("/embeddings"):
        return False
    temperature = body.get("temperature", default_temperature)
    if temperature is None:
        temperature = default_temperature
    return not _finite(temperature) or temperature > 0


def _finite(value: object) -> bool:
    if isinstance(value, bool):
        return False
    # An int is finite however long: math.isfinite converts it, and a 400-digit temperature
    # raised OverflowError there (a 500, and a traceback in the log).
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


class ResponseCache(Protocol):
    name: str

    async def get(self, key: str) -> CacheEntry | None: ...
    async def put(self, key: str, entry: CacheEntry) -> None: ...
    async def close(self) -> None: ...


class MemoryCache:
    """Per process: LRU bounded by bytes, entries kept ``ttl`` seconds."""

    name = "memory"

    def __init__(
        self, *, max_bytes: int, ttl: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.size_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    async def get(self, key: str) -> CacheEntry | None:
        item = self._items.get(key)
        if item is None:
            return None
        expires, data = item
        if self._clock() >= expires:
            self._drop(key)
            return None
        self._items.move_to_end(key)
        return CacheEntry.unpack(data)

    async def put(self, key: str, entry: CacheEntry) -> None:
        data = entry.pack()
        size = len(key) + len(data)
        if size > self.max_bytes:
            return
        if key in self._items:
            self._drop(key)
        self._items[key] = (self._clock() + self.ttl, data)
        self.size_bytes += size
        while self.size_bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    def _drop(self, key: str) -> None:
        _, data = self._items.pop(key)
        self.size_bytes -= len(key) + len(data)

    async def close(self) -> None:
        self._items.clear()
        self.size_bytes = 0
        self.max_bytes = 0  # a late write, from a request still on a replaced cache, keeps nothing


_MISS: Any = object()  # a Redis call that failed, told apart from a reply of None


class RedisCache:
    """Shared by every replica. Redis keeps the TTL. A failure or a reply slower than
    ``timeout`` is a miss, never an error; after one, Redis is skipped for ``backoff``
    seconds so that a dead Redis costs one timeout a second, not one per request."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        ttl: float,
        timeout: float = 0.05,
        on_error: Callable[[str], None] = lambda op: None,
        backoff: float = 1.0,
    ) -> None:
        self._client, failures = connect(url, timeout)
        self._refusals = refusals()
        # ValueError too: an entry that does not unpack is a miss.
        self._errors: tuple[type[BaseException], ...] = (*failures, ValueError)
        self.prefix = prefix
        self.ttl_ms = max(1, int(ttl * 1000))
        self.timeout = timeout
        self.backoff = backoff
        self._on_error = on_error
        self._down_until = 0.0  # 0: healthy
        self._probing = False
        self._closed = False  # replaced or stopped: a late call must not open a connection
        # A call waits here for one of the client's connections, within its timeout: refused
        # at once past them, a burst of 300 lookups on a healthy Redis was 200 misses; and one
        # that runs out of time here says this process is busy, not that Redis is up or down
        # (a pool that waited by itself failed such calls as an outage: the cache off a
        # second; counted as refusals, they ended a dead Redis's backoff).
        self._gate = asyncio.Semaphore(MAX_CONNECTIONS)

    def _skip(self) -> bool | None:
        """None: skip Redis; else whether this call is the probe. After a failure, Redis is
        skipped for ``backoff``; then one call probes it while the others still skip, so a
        hung Redis costs one timeout a second even under load."""
        if self._probing or time.monotonic() < self._down_until:
            self._on_error("skipped")
            return None
        if self._down_until:
            self._probing = True
            return True
        return False

    def _failed(self, op: str) -> None:
        self._down_until = time.monotonic() + self.backoff
        self._probing = False
        self._on_error(op)

    def _refused(self) -> None:
        # Redis answered (or this process had no connection free): it is not down, and a
        # write it refuses (out of memory) must not turn the reads off for everyone, nor
        # keep every later call a probe.
        self._down_until = 0.0
        self._probing = False
        self._on_error("refused")

    def _unsettled(self, probe: bool) -> None:
        # A call cancelled on the way (its client left, a shutdown) said nothing of Redis: if
        # it was the probe, the next call probes, where a probe that never settled left every
        # later call skipping Redis until a restart. Only the probe: a call from before the
        # failure, cancelled while the probe waits, must not let a second probe start.
        if probe:
            self._probing = False

    def _ok(self) -> None:
        self._down_until = 0.0
        self._probing = False

    async def _call(self, op: str, probe: bool, call: Callable[[], Awaitable[Any]]) -> Any:
        """``call()``'s reply, or `_MISS` when Redis failed it (settled as `_skip` says) or
        no connection of ours came free within ``timeout`` (Redis was not asked: it says
        nothing of Redis's health, which stays as it was)."""
        gate = self._gate
        try:
            async with asyncio.timeout(self.timeout):
                await gate.acquire()
        except TimeoutError:
            self._unsettled(probe)
            self._on_error("busy")
            return _MISS
        except BaseException:
            self._unsettled(probe)
            raise
        try:
            if self._closed:  # closed while this call waited: no connection opened again
                self._unsettled(probe)
                return _MISS
            if not probe and time.monotonic() < self._down_until:
                # Redis failed the calls ahead of this one while it waited: skipped, as the
                # calls that come now are (they went on to the dead Redis, 50 more of 300).
                self._on_error("skipped")
                return _MISS
            # Its own whole timeout once admitted: one shared with the wait failed a call
            # admitted late as an outage, against a healthy Redis.
            async with asyncio.timeout(self.timeout):
                reply = await call()
        except self._refusals:
            self._refused()
            return _MISS
        except self._errors:
            if self._closed:  # its connection closed under it: no news of Redis
                self._unsettled(probe)
            else:
                self._failed(op)
            return _MISS
        except BaseException:
            self._unsettled(probe)
            raise
        finally:
            gate.release()
        self._ok()
        return reply

    async def get(self, key: str) -> CacheEntry | None:
        probe = None if self._closed else self._skip()
        if probe is None:
            return None
        data = await self._call("get", probe, lambda: self._client.get(self.prefix + key))
        if not isinstance(data, bytes):
            return None
        try:
            return CacheEntry.unpack(data)
        except ValueError:
            self._on_error("corrupt")  # one bad value is not a sick Redis: no backoff
            return None

    async def put(self, key: str, entry: CacheEntry) -> None:
        try:
            data = entry.pack()
        except ValueError:  # (a lone surrogate in a string): no sick Redis, so no backoff
            self._on_error("corrupt")
            return
        probe = None if self._closed else self._skip()
        if probe is None:
            return
        key = self.prefix + key
        await self._call("put", probe, lambda: self._client.set(key, data, px=self.ttl_ms))

    async def close(self) -> None:
        self._closed = True
        await self._client.aclose()


def open_cache(
    backend: str,
    *,
    max_bytes: int,
    ttl: float,
    prefix: str,
    timeout: float,
    on_error: Callable[[str], None],
) -> ResponseCache:
    if backend == "memory":
        return MemoryCache(max_bytes=max_bytes, ttl=ttl)
    if backend.startswith(("redis://", "rediss://", "unix://")):
        return RedisCache(backend, prefix=prefix, ttl=ttl, timeout=timeout, on_error=on_error)
    raise ValueError(f"unknown cache backend {backend!r}: 'memory' or a redis:// URL")
