"""Coarse deadlines for the request path: many alarms on one loop timer.

Every request sets two deadlines (its `RequestWatch`, 50 ms in, and its try's timeout) and
nearly always cancels both long before they are due. On uvloop a `call_later` and its `cancel`
cost about 1.5 us (a libuv timer made, started, stopped and closed), 3 us a request. Here an
alarm is a dict entry in a slot of ``resolution`` seconds: setting and cancelling one is a
fraction of that, and one loop timer serves the earliest slot. Alarms run up to ``resolution``
(and a millisecond) late, which a deadline of seconds or the watch's 50 ms does not mind, and
never before they are due. Slots wait in a heap until due, even emptied: at most one per
``resolution`` of the longest delay (6,000 for the default 30 s try timeout, under a megabyte).
The timer is set for the earliest slot that still holds an alarm: 30 s after a burst, an idle
gateway woke for every emptied slot of the burst's try timeouts, every 5 ms for as long as the
burst had lasted (after 2,000 requests, 461 wakes in 3 s against 69 without them).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable

__all__ = ["Alarm", "Alarms"]

RESOLUTION = 0.005


class Alarm:
    """One deadline; `cancel` it when it is no longer needed (cheap, and safe twice)."""

    __slots__ = ("_slot", "callback")

    def __init__(self, callback: Callable[[], object], slot: dict[Alarm, None]) -> None:
        self.callback = callback
        self._slot: dict[Alarm, None] | None = slot

    def cancel(self) -> None:
        slot = self._slot
        if slot is not None:
            self._slot = None
            del slot[self]

    @property
    def pending(self) -> bool:
        return self._slot is not None


class Alarms:
    """Alarms of one event loop. Slots are numbered by loop time / ``resolution``; a heap holds
    the numbers of those not yet run, and one `call_at` of the loop waits for the earliest."""

    __slots__ = ("_armed", "_heap", "_loop", "_resolution", "_slots", "_timer")

    def __init__(self, resolution: float = RESOLUTION) -> None:
        if not resolution > 0:
            raise ValueError(f"resolution must be > 0, not {resolution!r}")
        self._resolution = resolution
        self._slots: dict[int, dict[Alarm, None]] = {}
        self._heap: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._armed = math.inf  # the slot the timer is set for

    def call_at(self, when: float, callback: Callable[[], object]) -> Alarm:
        """Run ``callback`` at loop time ``when``, or up to ``resolution`` after it."""
        number = math.ceil(when / self._resolution)
        slot = self._slots.get(number)
        if slot is None:
            slot = self._slots[number] = {}
            heapq.heappush(self._heap, number)
            if number < self._armed:
                self._arm(number)
        alarm = Alarm(callback, slot)
        slot[alarm] = None
        return alarm

    def _arm(self, number: int) -> None:
        loop = self._loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        self._armed = number
        # A millisecond past the slot's time: uvloop rounds a timer to whole milliseconds, and
        # one that fired early would find its slot not due yet.
        self._timer = loop.call_at(number * self._resolution + 0.001, self._run)

    def _run(self) -> None:
        self._timer = None
        self._armed = math.inf
        loop = self._loop
        assert loop is not None
        due = math.floor(loop.time() / self._resolution)
        heap, slots = self._heap, self._slots
        ready = []
        while heap and heap[0] <= due:
            ready.append(slots.pop(heapq.heappop(heap)))
        # All taken out before any runs: an alarm that a callback sets waits for its own slot.
        for slot in ready:
            for alarm in list(slot):
                if alarm._slot is None:
                    continue  # cancelled by a callback run before it in this round
                alarm._slot = None
                try:
                    alarm.callback()
                except Exception as exc:  # one alarm's failure must not keep the others back
                    loop.call_exception_handler(
                        {"message": "promptlb alarm failed", "exception": exc}
                    )
        while heap and not slots[heap[0]]:  # emptied by cancels: no need to wake for it
            del slots[heapq.heappop(heap)]
        if heap and heap[0] < self._armed:
            self._arm(heap[0])
