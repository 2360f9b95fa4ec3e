"""The emulator's own forecast of when a slot frees up, for the bench's live oracle."""

from __future__ import annotations

import pytest
from promptlb.emulator._forecast import Forecast


def test_free_slots_mean_no_wait() -> None:
    f = Forecast(2)
    f.queued("a", 3.0)
    f.started("a", 13.0)
    assert f.wait(10.0) == 0.0  # one of two slots is free


def test_a_newcomer_waits_for_the_earliest_slot_behind_the_queue() -> None:
    f = Forecast(2)
    for name, finish in (("a", 14.0), ("b", 11.0)):
        f.queued(name, 1.0)
        f.started(name, finish)
    assert f.wait(10.0) == pytest.approx(1.0)  # b's slot, at 11
    f.queued("c", 5.0)  # takes b's slot at 11 until 16
    f.queued("d", 0.5)  # takes a's at 14 until 14.5
    assert f.wait(10.0) == pytest.approx(4.5)
    f.done("b")  # b finished early: c starts now
    f.started("c", 15.0)
    assert f.wait(10.0) == pytest.approx(4.5)  # d at 14 still, then 14.5


def test_requests_that_leave_are_forgotten() -> None:
    f = Forecast(1)
    f.queued("a", 2.0)
    f.done("a")  # refused (queue full) or gone before its slot
    assert f.wait(0.0) == 0.0
