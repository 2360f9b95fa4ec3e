"""The capacity model: a fixed number of generation slots and a FIFO queue in front of them."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["Capacity", "QueueFull"]


class QueueFull(Exception):
    """The queue in front of the slots is at its bound."""


class Capacity:
    """Slots handed out strictly first come, first served.

    ``asyncio.Semaphore`` lets a newly arriving task take a slot that was just released ahead of
    a waiter that has not run yet; an explicit queue of futures keeps the order honest, so the
    measured queue wait is the one a real engine's scheduler would give.
    """

    def __init__(self, slots: int, max_queue: int) -> None:
        self.slots = slots
        self.max_queue = max_queue
        self.running = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.running >= self.slots or self._waiters:
            if len(self._waiters) >= self.max_queue:
                raise QueueFull
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._release()  # we were handed a slot just as we were cancelled
                elif waiter in self._waiters:  # _release may already have dropped it
                    self._waiters.remove(waiter)
                raise
        else:
            self.running += 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        # Hand the slot straight to the next waiter: running stays the same.
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1
