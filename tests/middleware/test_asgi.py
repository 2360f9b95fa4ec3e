"""RequestWatch, as a unit: one timer that times the body, then watches for a disconnect."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from promptlb.middleware._alarms import Alarms
from promptlb.middleware._asgi import RequestWatch


async def silent() -> dict[str, Any]:
    await asyncio.Event().wait()  # a client that sends nothing more
    raise AssertionError("unreachable")


async def test_a_body_past_its_deadline_cancels_the_reader_as_slow() -> None:
    watch = RequestWatch(silent, body_timeout=0.05, delay=0.01)
    with pytest.raises(asyncio.CancelledError):
        await silent()
    assert watch.slow and not watch.gone
    assert watch.uncancel() is True  # ours alone: taken back
    watch.close()


async def test_watching_at_once_keeps_the_body_deadline() -> None:
    # The batch path watches from the start; while the body is still coming its deadline stands.
    watch = RequestWatch(silent, body_timeout=0.05, delay=10.0)
    watch.watch_now()
    with pytest.raises(asyncio.CancelledError):
        await silent()
    assert watch.slow
    watch.uncancel()
    watch.close()


async def test_another_cancel_in_the_same_instant_is_not_taken_back() -> None:
    # A shutdown cancelling the task as the body's deadline passes: the caller must let the
    # shutdown's cancel through, not answer 408 and carry on. Both land before the task runs:
    # the deadline's alarm (due at once) and the other cancel, due with it in the same slot.
    task = asyncio.current_task()
    assert task is not None
    alarms = Alarms()
    watch = RequestWatch(silent, body_timeout=0.0, delay=1.0, alarms=alarms)
    alarms.call_at(asyncio.get_running_loop().time(), task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await silent()
    assert watch.slow
    assert task.cancelling() == 2
    assert watch.uncancel() is False
    task.uncancel()
    watch.close()


async def test_a_disconnect_after_the_body_cancels_as_gone() -> None:
    said: list[dict[str, Any]] = [{"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return said.pop()

    watch = RequestWatch(receive, body_timeout=5.0, delay=0.01)
    watch.body_read()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(5)
    assert watch.gone and not watch.slow
    assert watch.uncancel()
    watch.close()
