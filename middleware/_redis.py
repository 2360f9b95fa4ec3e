"""How the middleware reaches Redis, for the answer cache and the shared prefix index alike: a
client whose every call times out, and the exceptions that mean Redis failed (down, slow,
refusing), which callers turn into a miss or a skipped round, never into a request's error."""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_CONNECTIONS", "connect", "refusals"]

MAX_CONNECTIONS = 100  # per client; more calls at once wait their turn, within their timeout


def connect(url: str, timeout: float) -> tuple[Any, tuple[type[BaseException], ...]]:
    """A client for ``url`` and the exceptions its failures raise (`refusals` among them)."""
    import redis.asyncio  # only a deployment that uses Redis needs the extra

    # A pool that waits (up to the call's timeout) for a free connection: redis-py's default
    # refuses a call at once past 100 connections in use, so a burst of more lookups than
    # that against a healthy Redis came back as misses (300 at once: 200 refused).
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=timeout,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )
    client = redis.asyncio.Redis.from_pool(pool)  # closing the client closes its pool
    return client, (TimeoutError, OSError, redis.exceptions.RedisError)


def refusals() -> tuple[type[BaseException], ...]:
    """The failures that say Redis is up but refused one call: out of memory under
    ``noeviction`` (Redis's default policy), a read-only replica after a failover, a missing
    permission, or this process out of pooled connections. Not a reason to stop asking it:
    reads go on while writes are refused. Catch them before `connect`'s failures, which
    include them."""
    import redis.exceptions

    found: list[type[BaseException]] = [redis.exceptions.ResponseError]
    pool_full = getattr(redis.exceptions, "MaxConnectionsError", None)  # redis-py >= 6
    if pool_full is not None:
        found.append(pool_full)
    return tuple(found)
