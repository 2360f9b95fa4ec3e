"""ASGI types and the few canned responses the middleware sends itself."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["ASGIApp", "Receive", "Scope", "Send", "json_error", "send_json"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_json(
    send: Send, status: int, body: object, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def json_error(
    send: Send,
    status: int,
    message: str,
    kind: str,
    *,
    param: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """An error in the OpenAI shape, so that the official clients raise the right exception."""
    error = {"message": message, "type": kind, "param": param, "code": status}
    await send_json(send, status, {"error": error}, headers)
