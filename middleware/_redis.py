"""How the middleware reaches Redis, for the answer cache and the shared prefix index alike: a
client whose every call times out, and the exceptions that mean Redis failed (down, slow,
refusing), which callers turn into a miss or a skipped round, never into a request's error."""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_CONNECTIONS", "connect", "refusals"]

# Connections per client. redis-py refuses a call past them at once; a caller with bursts
# (the answer cache) queues its calls for them instead (`RedisCache`).
MAX_CONNECTIONS = 100


def connect(url: str, timeout: float) -> tuple[Any, tuple[type[BaseException], ...]]:
    """A client for ``url`` and the exceptions its failures raise (`refusals` among them)."""
    import redis.asyncio  # only a deployment that uses Redis needs the extra

    client = redis.asyncio.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        max_connections=MAX_CONNECTIONS,  # past it redis-py refuses a call at once
    )
    return client, (TimeoutError, OSError, redis.exceptions.RedisError)


def refusals() -> tuple[type[BaseException], ...]:
    """The failures that say Redis is up but refused one call: out of memory under
    ``noeviction`` (Redis's default policy), a read-only replica after a failover, a missing
    permission, or this process out of pooled connections (`RedisCache` queues its calls for
    them instead, and counts one that runs out of time waiting as busy, not as a refusal).
    Not a reason to stop asking it:
    reads go on while writes are refused. Catch them before `connect`'s failures, which
    include them."""
    import redis.exceptions

    found: list[type[BaseException]] = [redis.exceptions.ResponseError]
    pool_full = getattr(redis.exceptions, "MaxConnectionsError", None)  # redis-py >= 6
    if pool_full is not None:
        found.append(pool_full)
    return tuple(found)
