"""ASGI types and the few canned responses the middleware sends itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ._refusals import Refusal, error_body

__all__ = [
    "ASGIApp",
    "DisconnectWatch",
    "Receive",
    "Scope",
    "Send",
    "json_error",
    "send_json",
    "send_refusal",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# A request answered sooner than this never starts a watcher: most answers of a fast node come
# back within it, and a watcher costs a task on every request. A client that leaves is noticed
# this much later at worst.
WATCH_AFTER = 0.05


class DisconnectWatch:
    """Cancels the current task when the client disconnects, while ``armed``.

    One watcher future on ``receive()`` per request, started ``delay`` seconds in: the task
    awaiting a node is cancelled so that the upstream try unwinds (the node sees the
    disconnect). ``gone`` tells that cancel from any other; disarm before answering, so a late
    disconnect cancels nothing else, and `close` when done.
    """

    __slots__ = ("_receive", "_task", "_timer", "_watcher", "armed", "gone")

    def __init__(self, receive: Receive, delay: float = WATCH_AFTER) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._receive = receive
        self.armed = True
        self.gone = False
        self._watcher: asyncio.Future[Message] | None = None
        self._timer: asyncio.TimerHandle | None = None
        if delay > 0:
            self._timer = asyncio.get_running_loop().call_later(delay, self._start)
        else:
            self._start()

    def _start(self) -> None:
        self._timer = None
        if self.armed:
            self._watcher = asyncio.ensure_future(self._receive())
            self._watcher.add_done_callback(self._on_message)

    def _on_message(self, future: asyncio.Future[Message]) -> None:
        if (
            self.armed
            and not future.cancelled()
            and future.exception() is None
            and future.result()["type"] == "http.disconnect"
        ):
            self.gone = True
            self._task.cancel()

    def uncancel(self) -> None:
        """Take back our own cancel, for the client that left: nothing is left to answer."""
        self._task.uncancel()

    def close(self) -> None:
        self.armed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        watcher = self._watcher
        if watcher is not None and not watcher.done():
            watcher.remove_done_callback(self._on_message)
            watcher.cancel()


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
    await send_json(send, status, error_body(status, message, kind, param), headers)


async def send_refusal(send: Send, refusal: Refusal, retry_after: bytes) -> None:
    """``refusal`` as its status, error body and headers (``retry_after`` as `Refusal.headers`)."""
    await send_json(send, refusal.status, refusal.error(), refusal.headers(retry_after))
