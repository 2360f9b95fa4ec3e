"""Alarms: coarse deadlines on one loop timer, never run early, cheap to cancel."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from promptlb.middleware._alarms import Alarms


async def test_alarms_run_in_time_order_and_never_before_they_are_due() -> None:
    loop = asyncio.get_running_loop()
    alarms = Alarms(resolution=0.005)
    ran: list[tuple[str, float]] = []
    start = loop.time()

    def note(name: str, when: float) -> Callable[[], None]:
        return lambda: ran.append((name, loop.time() - when))

    for name, delay in (("late", 0.06), ("early", 0.02), ("middle", 0.04)):
        alarms.call_at(start + delay, note(name, start + delay))
    await asyncio.sleep(0.15)
    assert [name for name, _ in ran] == ["early", "middle", "late"]
    assert all(lateness >= 0.0 for _, lateness in ran)  # never before its time


async def test_a_cancelled_alarm_never_runs_and_cancelling_twice_is_harmless() -> None:
    loop = asyncio.get_running_loop()
    alarms = Alarms()
    ran: list[str] = []
    kept = alarms.call_at(loop.time() + 0.01, lambda: ran.append("kept"))
    dropped = alarms.call_at(loop.time() + 0.01, lambda: ran.append("dropped"))
    dropped.cancel()
    dropped.cancel()
    assert kept.pending and not dropped.pending
    await asyncio.sleep(0.05)
    assert ran == ["kept"]
    assert not kept.pending
    kept.cancel()  # after it ran: nothing to do


async def test_an_alarm_cancelled_by_one_due_with_it_does_not_run() -> None:
    loop = asyncio.get_running_loop()
    alarms = Alarms()
    ran: list[str] = []
    now = loop.time()

    def first_then_cancel() -> None:
        ran.append("first")
        second.cancel()

    first = alarms.call_at(now, first_then_cancel)
    second = alarms.call_at(now, lambda: ran.append("second"))
    await asyncio.sleep(0.03)
    assert ran == ["first"] and not first.pending and not second.pending


async def test_one_failing_alarm_does_not_keep_the_others_from_running() -> None:
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        alarms = Alarms()
        ran: list[str] = []

        def boom() -> None:
            raise RuntimeError("boom")

        alarms.call_at(loop.time(), boom)
        alarms.call_at(loop.time(), lambda: ran.append("after"))
        await asyncio.sleep(0.03)
    finally:
        loop.set_exception_handler(None)
    assert ran == ["after"]
    assert isinstance(seen[0]["exception"], RuntimeError)


async def test_an_alarm_set_by_an_alarm_for_now_runs_on_a_later_round() -> None:
    # A callback that sets another alarm already due (a body deadline checked a hair early)
    # must not keep the loop in one round for ever.
    loop = asyncio.get_running_loop()
    alarms = Alarms()
    count = 0
    third = asyncio.Event()

    def again() -> None:
        nonlocal count
        count += 1
        if count < 3:
            alarms.call_at(loop.time(), again)
        else:
            third.set()

    alarms.call_at(loop.time(), again)
    # Waited for, not slept on: one round each, and a stall may put two in one sleep's wake.
    await asyncio.wait_for(third.wait(), 5)
    await asyncio.sleep(0.05)
    assert count == 3  # and no more


async def test_an_earlier_alarm_set_later_moves_the_timer_up() -> None:
    loop = asyncio.get_running_loop()
    alarms = Alarms()
    ran: list[str] = []
    alarms.call_at(loop.time() + 10.0, lambda: ran.append("far"))
    alarms.call_at(loop.time() + 0.01, lambda: ran.append("near"))
    await asyncio.sleep(0.05)
    assert ran == ["near"]


async def test_the_timer_skips_slots_whose_alarms_were_all_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Most alarms are cancelled long before they are due (a try's 30 s timeout): an idle
    gateway must not wake for each emptied slot."""
    loop = asyncio.get_running_loop()
    rounds: list[float] = []
    run = Alarms._run

    def counted(self: Alarms) -> None:
        rounds.append(loop.time())
        run(self)

    monkeypatch.setattr(Alarms, "_run", counted)
    alarms = Alarms(resolution=0.005)
    ran: list[int] = []
    start = loop.time()
    set_ = [alarms.call_at(start + 0.01 * (i + 1), partial(ran.append, i)) for i in range(20)]
    for alarm in set_[:-1]:
        alarm.cancel()
    await asyncio.sleep(0.25)
    assert ran == [19]
    assert len(rounds) <= 2, len(rounds)  # the first slot (armed before the cancels), the last


def test_the_resolution_must_be_positive() -> None:
    with pytest.raises(ValueError, match="resolution"):
        Alarms(resolution=0.0)
