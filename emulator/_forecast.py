"""When the emulator's slots free up, as exactly as the node itself can know: what the bench's
live oracle asks (``POST /_emulator/oracle``) so that it picks as the simulator's oracle does,
by the true queue and the true cache rather than by a router's estimate of them.

A running request finishes when its prefill and its answer are done (known at its start); a
queued one will take the service its prompt costs against the cache as it is now (its cached
prefix may still change before it starts: the one inexactness, and the simulator's oracle
makes the same forecast). Pure and synchronous, on the caller's clock.
"""

from __future__ import annotations

import heapq

__all__ = ["Forecast"]


class Forecast:
    """The requests a node holds: running ones by when they finish, queued ones (first come,
    first served) by how long they will take."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._running: dict[object, float] = {}  # request -> when it finishes
        self._queued: dict[object, float] = {}  # request -> its service seconds, FIFO

    def queued(self, request: object, service_s: float) -> None:
        self._queued[request] = service_s

    def started(self, request: object, finish_at: float) -> None:
        self._queued.pop(request, None)
        self._running[request] = finish_at

    def done(self, request: object) -> None:
        self._queued.pop(request, None)
        self._running.pop(request, None)

    def wait(self, now: float) -> float:
        """Seconds until a request arriving now would get a slot."""
        free = sorted(self._running.values())[: self.slots]
        free += [now] * (self.slots - len(free))
        heapq.heapify(free)
        for service in self._queued.values():
            start = heapq.heappop(free)
            heapq.heappush(free, max(start, now) + service)
        return max(0.0, free[0] - now)
