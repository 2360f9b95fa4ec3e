"""Admission by priority: pure logic over node views, and the bounded queue on a real loop."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import pytest
from promptlb.middleware import Config, NodeConfig
from promptlb.middleware._balancer import Balancer
from promptlb.middleware._config import load_config
from promptlb.middleware._config_degrade import SheddingConfig
from promptlb.middleware._nodes import NodeTable
from promptlb.middleware._refusals import Shed
from promptlb.middleware._shedding import Admission, QueueTimeout
from promptlb.middleware._view import NodeView
from promptlb.shared import ConfigError

from tests.middleware.conftest import MakeNode


def admission(**options: object) -> Admission:
    config = load_config(
        {"nodes": [{"name": "a", "url": "http://a:1", "models": ["m"]}], "shedding": options}
    )
    return Admission(config.shedding, NodeTable(config))


def test_priority_may_be_lowered_by_anyone_and_raised_only_when_trusted() -> None:
    adm = admission(enabled=True, trusted_networks=["10.0.0.0/8"], priority_token="t0k")
    outsider = ("192.0.2.7", 5000)
    assert adm.priority(b"sheddable", None, outsider) == "sheddable"
    assert adm.priority(b"critical", None, outsider) == "standard"
    assert adm.priority(b"critical", b"wrong", outsider) == "standard"
    assert adm.priority(b"critical", b"t0k", outsider) == "critical"
    assert adm.priority(b"CRITICAL ", None, ("10.1.2.3", 1)) == "critical"
    assert adm.priority(b"bogus", None, outsider) == "standard"
    assert adm.priority(b"critical", None, None) == "standard"
    # An IPv4 client as a dual-stack listener reports it.
    assert adm.priority(b"critical", None, ("::ffff:10.1.2.3", 1)) == "critical"
    assert adm.priority(b"critical", None, ("::ffff:192.0.2.7", 1)) == "standard"
    mapped = admission(enabled=True, trusted_networks=["::ffff:10.0.0.0/104"])
    assert mapped.priority(b"critical", None, ("::ffff:10.1.2.3", 1)) == "critical"  # as written


def test_a_node_is_over_by_queue_kv_or_in_flight_and_unknown_load_is_not_saturation(
    node: MakeNode,
) -> None:
    adm = admission(enabled=True, max_waiting=4, max_kv=0.9, max_in_flight=3)
    assert not adm.over(node("a", running=1, waiting=4))
    assert adm.over(node("a", running=1, waiting=5))
    assert adm.over(node("a", running=1, waiting=0, kv_cache=0.95))
    unknown = node("a")
    assert not adm.over(unknown)
    unknown.in_flight = 3
    assert adm.over(unknown)
    # What we sent since the snapshot counts on top of the engine's queue.
    queued = node("a", running=1, waiting=3)
    queued.in_flight = 2
    assert adm.over(queued)
    assert adm.saturated([node("a", running=1, waiting=9), node("b", running=1, waiting=9)])
    assert not adm.saturated([node("a", running=1, waiting=9), node("b", running=1, waiting=0)])
    assert not adm.saturated([])


def test_bad_shedding_config_names_the_key() -> None:
    for key, value in [
        ("max_kv", 1.5),
        ("max_in_flight", 0),
        ("retry_after", 0),
        ("trusted_networks", ["not-a-net"]),
    ]:
        with pytest.raises(ConfigError, match=re.escape(f"shedding.{key}")):
            admission(**{key: value})
    assert "priority_token" not in repr(SheddingConfig(priority_token="secret"))
    with pytest.raises(ConfigError, match=r"shedding\.enabled"):  # no limit: would never shed
        admission(enabled=True, max_waiting=None, max_kv=None)
    admission(enabled=True, max_waiting=None, max_kv=None, max_in_flight=4)


async def test_queue_sheds_sheddable_at_once_and_times_out_standard() -> None:
    adm = admission(enabled=True, max_in_flight=1, queue_timeout=0.2, queue_size=1)
    node = adm._table.nodes["a"].view
    adm._table.candidates = lambda model: [node]  # type: ignore[method-assign]
    node.in_flight = 1
    with pytest.raises(Shed):
        await adm.admit("m", "sheddable")
    await adm.admit("m", "critical")  # through, saturated or not
    started = time.monotonic()
    first = asyncio.ensure_future(adm.admit("m", "standard"))
    await asyncio.sleep(0.01)
    with pytest.raises(QueueTimeout):  # the queue (size 1) is full: degrade (or 429) at once
        await adm.admit("m", "standard")
    with pytest.raises(QueueTimeout):
        await first
    assert 0.2 <= time.monotonic() - started < 2.0  # its queue_timeout, not a wait for room
    assert adm.waiting == 0


def full_node(monkeypatch: pytest.MonkeyPatch, places: int = 1) -> tuple[Admission, NodeView]:
    """An admission in front of one node with every one of its ``places`` taken, and waiters
    woken only by a wake: the recheck every 50 ms would also let them in (far apart, the
    wake is what is measured: at 50 ms a bound sat on the poll it was to rule out)."""
    monkeypatch.setattr("promptlb.middleware._shedding._POLL", 10.0)
    adm = admission(enabled=True, max_in_flight=places, queue_timeout=20)
    node = adm._table.nodes["a"].view
    adm._table.candidates = lambda model: [node]  # type: ignore[method-assign]
    node.in_flight = places
    return adm, node


async def test_a_waiter_is_woken_when_a_request_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    adm, node = full_node(monkeypatch)
    waiter = asyncio.ensure_future(adm.admit("m", "standard"))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    node.in_flight = 0
    adm.wake()
    started = time.monotonic()
    await asyncio.wait_for(waiter, 5)
    assert time.monotonic() - started < 2.0  # woken, not the 10 s poll


async def test_a_wake_goes_to_the_oldest_waiter_whose_model_has_room(
    monkeypatch: pytest.MonkeyPatch, node: MakeNode
) -> None:
    """Waiters of every model shared one line, and a wake went to the oldest: one waiting on a
    model still saturated found no room and queued again at the back, while the waiter that
    could go sat out its poll."""
    monkeypatch.setattr("promptlb.middleware._shedding._POLL", 10.0)
    adm = admission(enabled=True, max_in_flight=1, queue_timeout=20)
    views = {"a": node("a"), "b": node("b")}
    adm._table.candidates = lambda model: [views[model]]  # type: ignore[method-assign]
    views["a"].in_flight = views["b"].in_flight = 1
    on_a = asyncio.ensure_future(adm.admit("a", "standard"))
    await asyncio.sleep(0.01)
    on_b = asyncio.ensure_future(adm.admit("b", "standard"))
    await asyncio.sleep(0.01)
    views["b"].in_flight = 0  # b's request finished; a is still full
    adm.wake()
    await asyncio.wait_for(on_b, 5)  # woken, not the 10 s poll
    assert not on_a.done()
    views["a"].in_flight = 0
    adm.wake()
    await asyncio.wait_for(on_a, 5)
    assert adm.waiting == 0


@pytest.mark.parametrize("places", [1, 2])
async def test_woken_waiters_beaten_to_their_rooms_keep_their_places(
    monkeypatch: pytest.MonkeyPatch, places: int
) -> None:
    """Woken, and the room taken by a newcomer before it ran: a waiter queued again at the
    back, behind every later one, toward its timeout while they went in (one place); put back
    at the very front instead, the younger of two woken together went ahead (two places)."""
    adm, node = full_node(monkeypatch, places)
    older = asyncio.ensure_future(adm.admit("m", "standard"))
    await asyncio.sleep(0.01)
    younger = asyncio.ensure_future(adm.admit("m", "standard"))
    await asyncio.sleep(0.01)
    node.in_flight = 0
    for _ in range(places):
        adm.wake()  # woken ...
    node.in_flight = places  # ... and newcomers take the rooms before they run
    await asyncio.sleep(0.01)
    assert not older.done() and not younger.done()
    node.in_flight = places - 1
    adm.wake()
    await asyncio.wait_for(older, 5)  # the older, not the younger
    assert not younger.done()
    adm.wake()
    await asyncio.wait_for(younger, 5)


async def test_a_wake_given_to_a_waiter_that_then_left_passes_to_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Woken, then cancelled (its client gone) before it ran: the room it was given went to
    # no one, and the next waiter sat out its poll.
    adm, node = full_node(monkeypatch)
    gone = asyncio.ensure_future(adm.admit("m", "standard"))
    await asyncio.sleep(0.01)
    next_one = asyncio.ensure_future(adm.admit("m", "standard"))
    await asyncio.sleep(0.01)
    node.in_flight = 0
    adm.wake()  # to the first ...
    gone.cancel()  # ... which leaves before it runs
    with contextlib.suppress(asyncio.CancelledError):
        await gone
    await asyncio.wait_for(next_one, 5)  # woken, not the 10 s poll
    assert adm.waiting == 0


async def test_a_sheddable_newcomer_takes_no_room_a_queued_request_waits_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The room came back (a wake on its way, or given and not yet taken): a sheddable request
    # arriving then went in, and the standard one queued before it timed out into a 429.
    adm, node = full_node(monkeypatch)
    waiter = asyncio.ensure_future(adm.admit("m", "standard"))
    await asyncio.sleep(0.01)
    node.in_flight = 0  # room, no wake yet
    with pytest.raises(Shed):
        await adm.admit("m", "sheddable")
    adm.wake()  # given, not yet taken
    with pytest.raises(Shed):
        await adm.admit("m", "sheddable")
    await adm.admit("other", "sheddable")  # no one waits for that model: in
    await asyncio.wait_for(waiter, 5)
    await adm.admit("m", "sheddable")  # nobody queued any more: in
    assert adm.waiting == 0 and not adm._waiting_for


async def test_a_try_that_fails_wakes_a_waiter() -> None:
    # Only a passed-on answer woke one: a try that failed gave its place back silently, and
    # the waiters slept to their next poll while newcomers took the room.
    lb = Balancer(
        Config(
            nodes=(NodeConfig(name="a", url="http://127.0.0.1:9"),),
            shedding=SheddingConfig(enabled=True, max_in_flight=1),
        )
    )
    node = lb.table.nodes["a"]
    node.view.in_flight = 1
    woken: list[bool] = []
    lb.admission.waiting = 1
    lb.admission.wake = lambda: woken.append(True)  # type: ignore[method-assign]
    lb._let_go(node)
    assert woken == [True] and node.view.in_flight == 0
