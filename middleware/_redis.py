"""How the middleware reaches Redis, for the answer cache and the shared prefix index alike: a
client whose every call times out, and the exceptions that mean Redis failed (down, slow,
refusing), which callers turn into a miss or a skipped round, never into a request's error."""

from __future__ import annotations

from typing import Any

__all__ = ["connect"]


def connect(url: str, timeout: float) -> tuple[Any, tuple[type[BaseException], ...]]:
    """A client for ``url`` and the exceptions its failures raise."""
    import redis.asyncio  # only a deployment that uses Redis needs the extra

    client = redis.asyncio.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout
    )
    return client, (TimeoutError, OSError, redis.exceptions.RedisError)
