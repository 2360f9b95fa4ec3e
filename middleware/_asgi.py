"""ASGI types and the few canned responses the middleware sends itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ._alarms import Alarm, Alarms
from ._refusals import Refusal, error_body

__all__ = [
    "ASGIApp",
    "Receive",
    "RequestWatch",
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


# One timer per request, this far in: a request whose body is in and answer out by then (most
# of a fast node's) costs that timer and its cancel, nothing else. Only then does the body get a
# deadline of its own, or the connection a watcher; a client that leaves is noticed this much
# later at worst.
WATCH_AFTER = 0.05


class RequestWatch:
    """Times a request's body, then cancels the current task when the client disconnects.

    Made when the request starts; ``body_timeout`` seconds after that a body still coming
    cancels the task with ``slow`` set. `body_read` ends that part; from then on (and ``delay``
    seconds in at the earliest) one watcher future on ``receive()`` waits for a disconnect while
    ``armed``, and cancels the task awaiting a node so that the upstream try unwinds (the node
    sees the disconnect). ``gone`` tells that cancel from any other. Disarm before answering, so
    a late disconnect cancels nothing else, and `close` when done. `watch_now` skips the delay
    (a batch waits its window anyway).
    """

    __slots__ = (
        "_alarms",
        "_body_by",
        "_delayed",
        "_loop",
        "_receive",
        "_task",
        "_timer",
        "_watcher",
        "armed",
        "gone",
        "reading",
        "slow",
    )

    def __init__(
        self,
        receive: Receive,
        body_timeout: float | None = None,
        delay: float = WATCH_AFTER,
        *,
        alarms: Alarms | None = None,
    ) -> None:
        # current_task(loop): without a loop it asks for the running one again, and on 3.11
        # each such ask is a getpid() system call.
        self._loop = loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self._task = task
        self._receive = receive
        self.armed = True
        self.gone = False
        self.slow = False
        self.reading = body_timeout is not None
        self._body_by = loop.time() + body_timeout if body_timeout is not None else 0.0
        self._watcher: asyncio.Future[Message] | None = None
        self._delayed = False  # the delay has passed
        wait = delay if body_timeout is None else min(delay, body_timeout)
        # One of the proxy's shared alarms: a loop timer of its own costs a request 1.5 us.
        self._alarms = alarms = alarms if alarms is not None else Alarms()
        self._timer: Alarm | None = alarms.call_at(loop.time() + wait, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._delayed = True
        if self.reading:
            if self._loop.time() >= self._body_by:
                self.slow = True
                self._task.cancel()
            else:
                self._timer = self._alarms.call_at(self._body_by, self._tick)
        else:
            self._start()

    def body_read(self) -> None:
        """The body is in: no deadline for it any more; watch the connection from now, or
        from the delay on."""
        self.reading = False
        if self._delayed:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._start()

    def watch_now(self) -> None:
        if self.reading:
            return  # the body's deadline stands; the watch starts once the body is in
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._delayed = True
        self._start()

    def _start(self) -> None:
        if self.armed and self._watcher is None:
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

    def uncancel(self) -> bool:
        """Take back our own cancel (the client that left, the body too slow); False when
        another cancel is pending too (a shutdown in the same instant), which the caller must
        let through."""
        return self._task.uncancel() == 0

    def close(self) -> None:
        self.armed = False
        self.reading = False
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
