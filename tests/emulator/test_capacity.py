"""`Capacity` in-process: FIFO hand-over, counts, the queue bound and cancellation."""

from __future__ import annotations

import asyncio
import random
from contextlib import AsyncExitStack

import pytest
from promptlb.emulator._capacity import Capacity, QueueFull

STEP_TIMEOUT_S = 5.0


async def _settle() -> None:
    """Let every ready task run until it blocks (a few loop turns, bounded)."""
    for _ in range(10):
        await asyncio.sleep(0)


class _Holder:
    """A task that takes a slot, records when it got it, and holds it until released."""

    def __init__(self, cap: Capacity, name: str, order: list[str]) -> None:
        self.name = name
        self.acquired = asyncio.Event()
        self.release = asyncio.Event()
        self._cap = cap
        self._order = order
        self.task = asyncio.create_task(self._run(), name=name)

    async def _run(self) -> None:
        async with self._cap.slot():
            self._order.append(self.name)
            self.acquired.set()
            await self.release.wait()

    async def finish(self) -> None:
        self.release.set()
        await asyncio.wait_for(self.task, STEP_TIMEOUT_S)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, STEP_TIMEOUT_S)


def _counts(cap: Capacity) -> tuple[int, int]:
    return cap.running, cap.waiting


async def test_free_slots_are_taken_without_queueing() -> None:
    cap = Capacity(slots=3, max_queue=0)  # no queue at all: only free slots can be had
    order: list[str] = []
    holders = [_Holder(cap, f"h{i}", order) for i in range(3)]
    await _settle()
    assert _counts(cap) == (3, 0)
    assert order == ["h0", "h1", "h2"]
    with pytest.raises(QueueFull):
        async with cap.slot():
            pass
    for h in holders:
        await h.finish()
    assert _counts(cap) == (0, 0)


async def test_waiters_are_served_in_fifo_order_and_latecomers_do_not_barge() -> None:
    cap = Capacity(slots=1, max_queue=10)
    order: list[str] = []
    first = _Holder(cap, "first", order)
    await _settle()
    waiters = [_Holder(cap, f"w{i}", order) for i in range(5)]
    await _settle()
    assert _counts(cap) == (1, 5)
    assert order == ["first"]

    # Release and, in the same loop turn (before w0 has run), a newcomer asks for a slot:
    # a plain Semaphore would let it take the freed slot; the FIFO hands it to w0.
    first.release.set()
    await asyncio.wait_for(first.task, STEP_TIMEOUT_S)
    late = _Holder(cap, "late", order)
    assert cap.running == 1  # the slot went straight to w0: running never dipped
    for w in waiters:
        await w.finish()
    await late.finish()
    assert order == ["first", "w0", "w1", "w2", "w3", "w4", "late"]
    assert _counts(cap) == (0, 0)


async def test_running_and_waiting_counts_follow_each_release() -> None:
    cap = Capacity(slots=2, max_queue=10)
    order: list[str] = []
    holders = [_Holder(cap, f"r{i}", order) for i in range(5)]
    await _settle()
    assert _counts(cap) == (2, 3)
    expected = [(2, 2), (2, 1), (2, 0), (1, 0), (0, 0)]
    for holder, counts in zip(holders, expected, strict=True):
        await holder.finish()
        await _settle()
        assert _counts(cap) == counts
    assert order == ["r0", "r1", "r2", "r3", "r4"]


async def test_queue_full_at_max_queue_leaves_the_counts_alone() -> None:
    cap = Capacity(slots=1, max_queue=2)
    order: list[str] = []
    holders = [_Holder(cap, f"q{i}", order) for i in range(3)]  # 1 running + 2 waiting
    await _settle()
    assert _counts(cap) == (1, 2)
    for _ in range(3):
        with pytest.raises(QueueFull):
            async with cap.slot():
                pytest.fail("a full queue must not hand out a slot")
    assert _counts(cap) == (1, 2)
    await holders[0].finish()
    await _settle()
    assert _counts(cap) == (1, 1)
    extra = _Holder(cap, "extra", order)  # one place came free in the queue
    await _settle()
    assert _counts(cap) == (1, 2)
    for h in [*holders[1:], extra]:
        await h.finish()
    assert _counts(cap) == (0, 0)
    assert order == ["q0", "q1", "q2", "extra"]


async def test_cancelled_waiter_frees_its_place_in_the_queue() -> None:
    cap = Capacity(slots=1, max_queue=1)
    order: list[str] = []
    holder = _Holder(cap, "holder", order)
    await _settle()
    doomed = _Holder(cap, "doomed", order)
    await _settle()
    assert _counts(cap) == (1, 1)
    with pytest.raises(QueueFull):
        async with cap.slot():
            pass

    await _cancel(doomed.task)
    assert _counts(cap) == (1, 0)
    after = _Holder(cap, "after", order)  # the freed place can be taken again
    await _settle()
    assert _counts(cap) == (1, 1)

    await holder.finish()
    await after.finish()
    assert order == ["holder", "after"]  # the cancelled waiter never ran
    assert _counts(cap) == (0, 0)


async def test_cancelled_holder_frees_its_slot() -> None:
    cap = Capacity(slots=1, max_queue=5)
    order: list[str] = []
    holder = _Holder(cap, "holder", order)
    await _settle()
    assert _counts(cap) == (1, 0)
    await _cancel(holder.task)
    assert _counts(cap) == (0, 0)

    # And with a waiter behind it, the slot passes on to the waiter.
    holder = _Holder(cap, "holder2", order)
    await _settle()
    waiter = _Holder(cap, "waiter", order)
    await _settle()
    assert _counts(cap) == (1, 1)
    await _cancel(holder.task)
    await asyncio.wait_for(waiter.acquired.wait(), STEP_TIMEOUT_S)
    assert _counts(cap) == (1, 0)
    await waiter.finish()
    assert _counts(cap) == (0, 0)


async def test_waiter_cancelled_just_after_being_handed_the_slot_passes_it_on() -> None:
    cap = Capacity(slots=1, max_queue=5)
    order: list[str] = []
    held = AsyncExitStack()  # this task holds the slot, so it can release it without yielding
    await held.enter_async_context(cap.slot())
    handed = _Holder(cap, "handed", order)
    nxt = _Holder(cap, "next", order)
    await _settle()
    assert _counts(cap) == (1, 2)

    # Leaving the slot hands it to `handed` (its future resolves) and, in the same loop turn,
    # before `handed` has run, it is cancelled. The slot must not be lost: it goes on to `next`.
    await held.aclose()
    assert _counts(cap) == (1, 1)
    await _cancel(handed.task)
    await asyncio.wait_for(nxt.acquired.wait(), STEP_TIMEOUT_S)
    assert _counts(cap) == (1, 0)
    await nxt.finish()
    assert order == ["next"]  # `handed` never entered its block
    assert _counts(cap) == (0, 0)


async def test_an_error_inside_the_slot_releases_it() -> None:
    cap = Capacity(slots=1, max_queue=1)

    async def fail_inside() -> None:
        async with cap.slot():
            assert _counts(cap) == (1, 0)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await fail_inside()
    assert _counts(cap) == (0, 0)


async def test_mixed_workload_never_exceeds_slots_and_drains_to_zero() -> None:
    cap = Capacity(slots=3, max_queue=1000)
    rng = random.Random(5)
    peak = 0
    done: list[int] = []
    gate = asyncio.Event()  # holders wait here until the counts are checked: no timing race

    async def job(i: int, hold_s: float) -> None:
        nonlocal peak
        async with cap.slot():
            peak = max(peak, cap.running)
            assert cap.running <= cap.slots
            await gate.wait()
            await asyncio.sleep(hold_s)
        done.append(i)

    tasks = [asyncio.create_task(job(i, rng.uniform(0, 0.005))) for i in range(60)]
    await _settle()
    assert cap.running == 3
    assert cap.waiting == 57
    gate.set()
    # Cancel a few, some still queued, some perhaps already running.
    for t in tasks[10:60:7]:
        t.cancel()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), STEP_TIMEOUT_S)
    cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert cancelled == len(tasks[10:60:7])
    assert len(done) == 60 - cancelled
    assert peak == 3
    assert _counts(cap) == (0, 0)
