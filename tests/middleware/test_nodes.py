"""The node table's rules, driven with explicit times (pure logic, no I/O)."""

from __future__ import annotations

import logging
import random
from collections import Counter

import pytest
from promptlb.middleware import Config, NodeConfig
from promptlb.middleware._config import HealthConfig, OutlierConfig
from promptlb.middleware._nodes import Node, NodeTable
from promptlb.middleware._predictive import Predictive
from promptlb.middleware._rules import ERROR_FLOOR, ERROR_HALF_LIFE
from promptlb.middleware._scoring import PowerOfTwoChoices
from promptlb.middleware._view import RouteRequest
from promptlb.shared import SEQ_EPOCH_BITS, Snapshot

from tests.middleware.conftest import MakeSnapshot


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(n: int = 3, **config: object) -> NodeTable:
    nodes = tuple(
        NodeConfig(name=f"n{i}", url=f"http://127.0.0.1:{9000 + i}", models=("m",))
        for i in range(n)
    )
    clock = Clock()
    t = NodeTable(Config(nodes=nodes, **config), clock=clock)  # type: ignore[arg-type]
    t.clock = clock  # type: ignore[attr-defined]
    for node in t.nodes.values():
        t.record_health(node, True, "ok", 0.0)
    t.settled = True
    t.tick(0.0)
    return t


def names(t: NodeTable, now: float | None = None) -> set[str]:
    if now is not None:
        t.clock.now = now  # type: ignore[attr-defined]
        t.tick(now)
    return {v.name for v in t.candidates("m") or ()}


def test_health_flips_only_after_the_thresholds() -> None:
    t = table(health=HealthConfig(unhealthy_threshold=2, healthy_threshold=3))
    n0 = t.nodes["n0"]
    t.record_health(n0, False, "503", 1.0)
    assert "n0" in names(t, 1.0)  # one failure is not enough
    t.record_health(n0, False, "503", 2.0)
    assert "n0" not in names(t, 2.0)
    for when in (3.0, 4.0):
        t.record_health(n0, True, "200", when)
    assert "n0" not in names(t, 4.0)
    t.record_health(n0, True, "200", 5.0)
    assert "n0" in names(t, 5.0)


def test_consecutive_failures_eject_for_base_time_times_ejections_within_the_cap() -> None:
    t = table(
        4,
        outlier=OutlierConfig(
            consecutive_failures=2, base_ejection_time=10, max_ejection_percent=50
        ),
    )
    n0, n1, n2 = t.nodes["n0"], t.nodes["n1"], t.nodes["n2"]
    for node in (n0, n0, n1, n1, n2, n2):
        t.record_result(node, False, None, None, 1.0)
    assert names(t, 1.0) == {"n2", "n3"}  # 50% of 4: the third ejection is refused
    assert names(t, 10.9) == {"n2", "n3"}
    assert names(t, 11.0) == {"n0", "n1", "n2", "n3"}
    t.record_result(n0, False, None, None, 12.0)
    t.record_result(n0, False, None, None, 12.0)
    assert n0.ejected_until == 32.0  # ejected a second time: twice as long


def test_nodes_without_models_share_one_ejection_pool() -> None:
    # Model-less nodes take any model, so failing together they must not all be ejected.
    nodes = tuple(NodeConfig(name=f"n{i}", url=f"http://127.0.0.1:{9000 + i}") for i in range(4))
    t = NodeTable(Config(nodes=nodes, outlier=OutlierConfig(consecutive_failures=5)))
    for node in t.nodes.values():
        t.record_health(node, True, "ok", 0.0)
    for node in t.nodes.values():
        for _ in range(5):
            t.record_result(node, False, None, None, 1.0)
    t.tick(1.0)
    assert sum(1 for n in t.nodes.values() if n.ejected_until) == 2  # 50% of 4
    assert len(t.candidates("m") or ()) == 2


def test_a_node_without_models_counts_in_every_models_pool() -> None:
    nodes = (
        NodeConfig(name="a", url="http://127.0.0.1:9000", models=("m",)),
        NodeConfig(name="b", url="http://127.0.0.1:9001", models=("m",)),
        NodeConfig(name="any", url="http://127.0.0.1:9002"),
    )
    t = NodeTable(Config(nodes=nodes, outlier=OutlierConfig(consecutive_failures=1)))
    for node in t.nodes.values():
        t.record_health(node, True, "ok", 0.0)
    for name in ("a", "b", "any"):
        t.record_result(t.nodes[name], False, None, None, 1.0)
    t.tick(1.0)
    # 50% of 3 is one: the first ejection is allowed, the others would leave m fewer than half.
    assert [n.name for n in t.nodes.values() if n.ejected_until] == ["a"]
    assert {v.name for v in t.candidates("m") or ()} == {"b", "any"}


def test_an_ejection_and_the_return_each_log_one_line(caplog: pytest.LogCaptureFixture) -> None:
    t = table(2, outlier=OutlierConfig(consecutive_failures=2, base_ejection_time=10))
    n0 = t.nodes["n0"]
    with caplog.at_level(logging.INFO, logger="promptlb.middleware"):
        for _ in range(2):
            t.record_result(n0, False, None, None, 1.0)
        t.tick(5.0)
        t.tick(11.0)
        t.tick(12.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "node n0: ejected for 10s after 2 failures in a row (ejection 1)",
        "node n0: back from ejection, ramping up",
    ]


def test_a_request_fault_counts_neither_way() -> None:
    t = table(outlier=OutlierConfig(consecutive_failures=2))
    n0 = t.nodes["n0"]
    t.record_result(n0, False, None, None, 1.0)
    for _ in range(10):
        t.record_request_fault(n0)
    assert (n0.consecutive_failures, n0.failures, n0.request_faults) == (1, 1, 10)
    assert n0.view.error_rate == pytest.approx(0.2)
    assert "n0" in names(t)


def test_the_error_rate_halves_with_each_half_life_and_reads_zero_below_the_floor() -> None:
    t = table()
    n0 = t.nodes["n0"]
    for _ in range(4):
        t.record_result(n0, False, None, None, 1.0)
    hurt = 1 - 0.8**4
    assert n0.view.error_rate == pytest.approx(hurt)
    assert "n0" in names(t, 1.0)  # four failures in a row: not yet ejected
    names(t, 1.0 + ERROR_HALF_LIFE)
    assert n0.view.error_rate == pytest.approx(hurt / 2)
    names(t, 1.0 + ERROR_HALF_LIFE)  # the same time again fades nothing more
    assert n0.view.error_rate == pytest.approx(hurt / 2)
    names(t, 1.0 + 2 * ERROR_HALF_LIFE)
    assert n0.view.error_rate == pytest.approx(hurt / 4)
    names(t, 1.0 + 5 * ERROR_HALF_LIFE)
    assert n0.view.error_rate == pytest.approx(hurt / 32)
    assert hurt / 64 < ERROR_FLOOR
    names(t, 1.0 + 6 * ERROR_HALF_LIFE)
    assert n0.view.error_rate == 0.0


def test_a_node_sent_nothing_for_its_failures_is_tried_again_once_they_fade() -> None:
    # Predictive weighs the error rate and picks between the two best nodes: a node that failed
    # a few tries (a hang: its tries timed out) gets nothing while two others serve, so no answer
    # ever lowered its rate. It got no request again for the rest of a fault suite, and did not
    # leak when that was the next fault.
    t = table()
    strategy = Predictive(PowerOfTwoChoices())
    asked = RouteRequest(model="m", input_tokens=20, max_tokens=8, stream=False)
    for node in t.nodes.values():
        for _ in range(10):
            strategy.observe(asked, node.view, 0.05, None, 0)
    n0 = t.nodes["n0"]
    for _ in range(4):
        t.record_result(n0, False, None, None, 1.0)
    rng = random.Random(7)

    def picks(now: float) -> Counter[str]:
        candidates = [t.nodes[n].view for n in sorted(names(t, now))]
        return Counter(strategy.pick(asked, candidates, rng).name for _ in range(200))

    assert picks(1.0)["n0"] == 0
    assert picks(1.0 + 2 * ERROR_HALF_LIFE)["n0"] == 0  # still fading
    assert picks(1.0 + 8 * ERROR_HALF_LIFE)["n0"] > 0


def test_the_decode_rate_follows_snapshots_and_survives_a_stall(snap: MakeSnapshot) -> None:
    t = table()
    n0 = t.nodes["n0"]
    assert n0.decode_rate is None
    t.record_snapshot(n0, snap("n0", 1, running=4, tps=200.0), 1.0)
    assert n0.decode_rate == 50.0  # per running request
    t.record_snapshot(n0, snap("n0", 2, running=4, tps=0.0), 1.1)  # hung: generates nothing
    t.record_snapshot(n0, snap("n0", 3, running=0, tps=None), 1.2)  # idle
    assert n0.decode_rate == 50.0


def test_a_success_resets_the_failure_count() -> None:
    t = table(outlier=OutlierConfig(consecutive_failures=2))
    n0 = t.nodes["n0"]
    for ok in (False, True, False, True, False):
        t.record_result(n0, ok, 0.1 if ok else None, None, 1.0)
    assert "n0" in names(t)


def test_a_stale_snapshot_is_not_load_evidence(snap: MakeSnapshot) -> None:
    t = table(stale_after=5.0)
    n0 = t.nodes["n0"]
    t.record_snapshot(n0, snap("n0", 1, running=7), now=1.0)
    t.tick(2.0)
    assert n0.view.engine_queue == 7
    t.tick(6.5)
    assert n0.view.snapshot is None  # unknown load, not idle
    assert n0.view.engine_queue is None
    assert "n0" in names(t)  # still a candidate: health decides that, not gossip


def test_a_snapshot_that_changes_no_state_is_read_at_once_without_a_rebuild(
    snap: MakeSnapshot,
) -> None:
    """Every snapshot rebuilt the candidate lists: at 1,000 nodes 1.4 ms before nearly every
    pick while a gossip round came in. The views carry the snapshot; the lists change only
    when a node's state does."""
    t = table(stale_after=5.0)
    n0 = t.nodes["n0"]
    t.record_snapshot(n0, snap("n0", 1, running=1), 1.0)
    lists = t.candidates("m")
    newer = snap("n0", 2, running=6)
    t.record_snapshot(n0, newer, 1.5)
    assert t.candidates("m") is lists  # no rebuild
    assert n0.view.snapshot is newer and n0.view.engine_queue == 6  # read at once
    t.record_health(n0, True, "ok", 1.6)  # a health check that changes nothing
    assert t.candidates("m") is lists
    t.record_snapshot(n0, snap("n0", 3, running=6, draining=True), 2.0)
    assert names(t) == {"n1", "n2"}  # a state change: rebuilt
    t.record_snapshot(n0, snap("n0", 4, running=0), 2.5)
    assert names(t) == {"n0", "n1", "n2"}
    t.tick(8.0)  # stale: unknown load, still a candidate
    assert n0.view.snapshot is None and names(t) == {"n0", "n1", "n2"}


def test_a_warm_snapshot_after_a_stale_warming_one_brings_the_node_back(
    snap: MakeSnapshot,
) -> None:
    """Compared with the state just before it, the warm snapshot changed nothing (the stale
    one already read as ready), so the node warming when the lists were built stayed out:
    for a model with only that node, every request a 503 (found in review)."""
    t = table(1, stale_after=5.0)
    n0 = t.nodes["n0"]
    t.record_snapshot(n0, snap("n0", 1, warm=False), 1.0)
    assert names(t, 1.0) == set()  # warming
    t.record_snapshot(n0, snap("n0", 2), 6.5)  # the first since, after stale_after, no tick
    assert {v.name for v in t.candidates("m") or ()} == {"n0"}
    assert t.serving(n0)


def test_an_older_snapshot_never_replaces_a_newer_one(snap: MakeSnapshot) -> None:
    t = table()
    n0 = t.nodes["n0"]
    assert t.record_snapshot(n0, snap("n0", 5, running=5), 1.0)
    assert not t.record_snapshot(n0, snap("n0", 4, running=4), 1.1)
    assert n0.snapshot is not None and n0.snapshot.seq == 5
    assert t.record_snapshot(n0, snap("n0", 1, boot="b2", running=1), 1.2)  # a new boot


def test_a_snapshot_counts_the_other_replicas_requests_from_then_on(snap: MakeSnapshot) -> None:
    # What they shared since the last one is in the new snapshot's engine count now.
    t = table()
    n0 = t.nodes["n0"]
    n0.view.others_since_snapshot = 3
    assert t.record_snapshot(n0, snap("n0", 5, running=5), 1.1)
    assert n0.view.others_since_snapshot == 0
    n0.view.others_since_snapshot = 2
    assert not t.record_snapshot(n0, snap("n0", 4, running=4), 1.2)  # older: counts stand
    assert n0.view.others_since_snapshot == 2


def test_warming_and_draining_nodes_get_no_requests(snap: MakeSnapshot) -> None:
    t = table()
    t.record_snapshot(t.nodes["n0"], snap("n0", 1, warm=False, running=0), 1.0)
    t.record_snapshot(t.nodes["n1"], snap("n1", 1, draining=True, running=0), 1.0)
    assert names(t, 1.0) == {"n2"}
    assert t.state_of(t.nodes["n0"]) == "warming"
    assert t.state_of(t.nodes["n1"]) == "draining"


def test_slow_start_ramps_a_recovered_node() -> None:
    t = table(slow_start=10.0)
    n0 = t.nodes["n0"]
    assert n0.view.ramp == 1.0  # the starting cluster is not slowed
    for when in (1.0, 2.0):
        t.record_health(n0, False, "503", when)
    for when in (3.0, 4.0):
        t.record_health(n0, True, "200", when)
    t.tick(4.0)
    assert n0.view.ramp == 0.1
    t.tick(9.0)
    assert n0.view.ramp == 0.5
    t.tick(20.0)
    assert n0.view.ramp == 1.0


def test_in_flight_at_snapshot_is_remembered_for_the_effective_queue(snap: MakeSnapshot) -> None:
    t = table()
    n0 = t.nodes["n0"]
    n0.view.in_flight = 3
    t.record_snapshot(n0, snap("n0", 1, running=5), 1.0)  # 3 of those 5 are ours
    t.tick(1.0)
    n0.view.in_flight = 4
    assert n0.view.effective_queue == 4 + 2
    n0.view.others_since_snapshot = 3  # the other replicas sent 3 more since, they told
    assert n0.view.effective_queue == 4 + 2 + 3
    n0.view.others_since_snapshot = -5  # theirs ended, and more: no fewer than ours
    assert n0.view.effective_queue == 4


def test_the_same_engine_reading_sent_again_keeps_the_count_of_ours_since_it(
    snap: MakeSnapshot,
) -> None:
    # A busy engine answers /metrics late: its sidecar keeps the last reading, and its other
    # collectors' news sends it again under new seqs. Each was taken as a new reading, and the
    # count of our requests since it re-based: the two sent since vanished from the queue.
    t = table()
    n0 = t.nodes["n0"]
    n0.view.in_flight = 3
    epoch = 4 << SEQ_EPOCH_BITS  # (a v2 sidecar's seq: its epoch is its engine reading's)
    t.record_snapshot(n0, snap("n0", epoch, running=5, tps=50.0, v=2), 1.0)  # 3 are ours
    rate = n0.decode_rate
    n0.view.in_flight = 5
    n0.view.others_since_snapshot = 2  # and the other replicas told of 2 more
    assert n0.view.effective_queue == 5 + 2 + 2
    again = snap("n0", epoch + 1, running=5, tps=90.0, age_ms=800, v=2)
    t.record_snapshot(n0, again, 1.5)
    assert n0.view.snapshot is again  # its other news taken
    assert n0.view.effective_queue == 5 + 2 + 2  # the same reading: the same queue
    assert n0.decode_rate == rate  # nor learnt from twice (its tps differs to show it)
    newer = snap("n0", 5 << SEQ_EPOCH_BITS, running=5, v=2)  # a new reading: re-based
    t.record_snapshot(n0, newer, 2.0)
    assert (n0.view.in_flight_at_snapshot, n0.view.others_since_snapshot) == (5, 0)
    assert n0.view.effective_queue == 5
    # A v1 sidecar's seq says nothing of its readings: each snapshot is a new one, as before.
    t.record_snapshot(n0, snap("n0", 6 << SEQ_EPOCH_BITS, running=9), 2.5)
    n0.view.in_flight = 7
    t.record_snapshot(n0, snap("n0", (6 << SEQ_EPOCH_BITS) + 1, running=9), 3.0)
    assert n0.view.in_flight_at_snapshot == 7


def test_unknown_models_and_nodes_without_models() -> None:
    t = table()
    assert t.candidates("other") is None
    wild = NodeTable(Config(nodes=(NodeConfig(name="w", url="http://127.0.0.1:1"),)))
    wild.record_health(wild.nodes["w"], True, "ok", 0.0)
    assert [v.name for v in wild.candidates("anything") or ()] == ["w"]


def test_discovery_keeps_known_nodes_and_their_state() -> None:
    t = table(2)
    n0 = t.nodes["n0"]
    n0.requests = 42
    t.replace_members(
        [
            NodeConfig(name="n0", url="http://127.0.0.1:9000", models=("m",)),
            NodeConfig(name="new", url="http://127.0.0.1:9100", models=("m",)),
        ]
    )
    assert set(t.nodes) == {"n0", "new"}
    assert t.nodes["n0"] is n0
    assert t.state_of(t.nodes["new"]) == "unknown"


def test_a_node_added_without_health_checks_is_ready_on_the_tables_clock() -> None:
    clock = Clock()
    clock.now = 1234.5  # far from time.monotonic(): the table must not read the wall clock
    nodes = (NodeConfig(name="a", url="http://127.0.0.1:9000"),)
    t = NodeTable(Config(nodes=nodes, health=HealthConfig(enabled=False)), clock=clock)
    # The starting cluster: ready a whole slow start (30 s) ago, on the table's clock.
    assert t.nodes["a"].ready_since == 1234.5 - 30.0


def test_a_node_projected_out_of_memory_is_drained_and_back_after_a_clean_restart(
    snap: MakeSnapshot, caplog: pytest.LogCaptureFixture
) -> None:
    from dataclasses import replace

    t = table(outlier=OutlierConfig(drain_before_oom=300.0))
    n0 = t.nodes["n0"]
    growing = replace(snap("n0", 1), rss=2**30, rss_slope=10 * 2**20, mem_free=1000 * 2**20)
    assert growing.seconds_to_oom() == pytest.approx(100.0)  # 1,000 MB left at 10 MB/s
    with caplog.at_level("INFO", logger="promptlb.middleware"):
        t.record_snapshot(n0, growing, 1.0)
        assert t.state_of(n0) == "leaking"
        assert names(t, 1.0) == {"n1", "n2"}  # new requests elsewhere
        # Drained, it stops growing: a flat slope alone does not bring it back ...
        flat = replace(snap("n0", 2), rss=2**30, rss_slope=0.0, mem_free=1000 * 2**20)
        t.record_snapshot(n0, flat, 1.5)
        assert names(t, 1.5) == {"n1", "n2"}
        # ... its memory freed does
        freed = replace(snap("n0", 3), rss=2**29, rss_slope=-(2**20), mem_free=1500 * 2**20)
        t.record_snapshot(n0, freed, 1.7)
        assert names(t, 1.7) == {"n0", "n1", "n2"}
        t.record_snapshot(n0, replace(growing, seq=4), 2.0)
        assert t.state_of(n0) == "leaking"
        restarted = replace(snap("n0", 1, boot="fresh"), rss=2**28, rss_slope=0.0, mem_free=2**33)
        t.record_snapshot(n0, restarted, 3.0)
        assert t.state_of(n0) == "ready" and "n0" in names(t, 3.0)
    lines = [r.getMessage() for r in caplog.records if "memory" in r.getMessage()]
    assert len(lines) == 4 and "draining" in lines[0] and "100s" in lines[0]


def _drained(snap: MakeSnapshot) -> tuple[NodeTable, Node, Snapshot]:
    """A table (slow start 10 s) whose node n0 was marked leaking at t=1 by the snapshot
    returned: 1,000 MB left at 10 MB/s."""
    from dataclasses import replace

    t = table(slow_start=10.0, outlier=OutlierConfig(drain_before_oom=300.0))
    n0 = t.nodes["n0"]
    growing = replace(snap("n0", 1), rss=2**30, rss_slope=10 * 2**20, mem_free=1000 * 2**20)
    t.record_snapshot(n0, growing, 1.0)
    return t, n0, growing


def test_a_node_back_from_a_leak_drain_ramps_up_and_a_quiet_sidecar_does_not_end_the_drain(
    snap: MakeSnapshot,
) -> None:
    # Back from the drain it had its full share at once (a restarted server, cold in all but
    # name); and its sidecar gone quiet for stale_after gave that share back with the mark
    # still standing (the node flapping between leaking and ready as the sidecar came and went).
    from dataclasses import replace

    t, n0, _ = _drained(snap)
    assert names(t, 1.0) == {"n1", "n2"}
    assert names(t, 20.0) == {"n1", "n2"}  # its snapshot stale, the mark still stands
    assert t.state_of(n0) == "leaking"
    restarted = replace(snap("n0", 1, boot="fresh"), rss=2**28, rss_slope=0.0, mem_free=2**33)
    t.record_snapshot(n0, restarted, 30.0)
    assert names(t, 30.0) == {"n0", "n1", "n2"}
    assert n0.view.ramp == 0.1  # ramped up from its return
    t.tick(40.0)
    assert n0.view.ramp == 1.0


def test_a_leak_drained_node_down_and_back_up_is_in_again_ramping_even_with_its_sidecar_gone(
    snap: MakeSnapshot,
) -> None:
    # The mark was cleared by a snapshot alone: with its sidecar gone for good, a node whose
    # model server had restarted stayed drained for good. And a mark cleared while the node
    # was unhealthy set its ramp's start then, so it came back at its full share.
    from dataclasses import replace

    t, n0, growing = _drained(snap)
    for when in (100.0, 101.0, 102.0):  # its model server killed for its memory
        t.record_health(n0, False, "refused", when)
    for when in (160.0, 161.0, 162.0):  # back, the sidecar never again
        t.record_health(n0, True, "200", when)
    assert names(t, 162.0) == {"n0", "n1", "n2"} and n0.view.ramp == 0.1
    # With its sidecar still answering, a blip of failed checks is no restart: still drained.
    t3, k0, _ = _drained(snap)
    drained = replace(growing, seq=2, rss_slope=0.0)
    for when in (2.0, 3.0, 4.0):
        t3.record_health(k0, False, "timeout", when)
    t3.record_snapshot(k0, drained, 4.5)
    for when in (5.0, 6.0, 7.0):
        t3.record_health(k0, True, "200", when)
    t3.record_snapshot(k0, replace(drained, seq=3), 7.5)
    assert names(t3, 7.5) == {"n1", "n2"}

    t2, m0, _ = _drained(snap)
    for when in (2.0, 3.0, 4.0):
        t2.record_health(m0, False, "503", when)
    freed = replace(snap("n0", 2), rss=2**28, rss_slope=0.0, mem_free=2**33)
    t2.record_snapshot(m0, freed, 5.0)
    for when in (100.0, 101.0, 102.0):
        t2.record_health(m0, True, "200", when)
    t2.tick(102.0)
    assert m0.view.ramp == 0.1


def test_leaking_nodes_still_serve_a_model_nothing_else_serves(snap: MakeSnapshot) -> None:
    from dataclasses import replace

    t = table(2)
    for name in ("n0", "n1"):
        leak = replace(snap(name, 1), rss=2**30, rss_slope=2**20, mem_free=2**20)
        t.record_snapshot(t.nodes[name], leak, 1.0)
    assert names(t, 1.0) == {"n0", "n1"}  # a node near its OOM beats none


def test_a_drained_leaking_node_is_back_once_its_model_server_restarts(snap: MakeSnapshot) -> None:
    """A restart of the model server alone keeps the sidecar's boot, but the sidecar warms the
    new process again: that not-warm snapshot ends the drain, whatever the fresh RSS."""
    from dataclasses import replace

    t = table()
    n0 = t.nodes["n0"]
    leak = replace(snap("n0", 1), rss=2**28, rss_slope=2**20, mem_free=2**24)
    t.record_snapshot(n0, leak, 1.0)
    assert t.state_of(n0) == "leaking"
    rewarming = replace(snap("n0", 2, warm=False), rss=2**28, rss_slope=0.0, mem_free=2**30)
    t.record_snapshot(n0, rewarming, 2.0)
    assert t.state_of(n0) == "warming"
    t.record_snapshot(n0, replace(rewarming, seq=3, warm=True), 3.0)
    assert t.state_of(n0) == "ready"


def test_memory_grown_while_loading_and_warming_does_not_mark_the_node_leaking(
    snap: MakeSnapshot, caplog: pytest.LogCaptureFixture
) -> None:
    """A model loading its weights (2 GB to 10 GB in 40 s under a 24 GB limit) and then warming
    up grows as fast as a leak, but routes nothing: the node is warming, never leaking, and
    ready once warm with its memory flat."""
    from dataclasses import replace

    t = table(outlier=OutlierConfig(drain_before_oom=300.0))
    n0 = t.nodes["n0"]
    gib, slope = 2**30, 200 * 2**20  # 8 GiB in 40 s
    with caplog.at_level("INFO", logger="promptlb.middleware"):
        for seq, second in enumerate(range(0, 41, 4), start=1):
            rss = 2 * gib + slope * second
            loading = replace(
                snap("n0", seq, ready=seq > 5, warm=False),
                rss=rss,
                rss_slope=float(slope),
                mem_free=24 * gib - rss,
            )
            left = loading.seconds_to_oom()
            assert left is not None and left < 300.0  # as fast as a leak that would OOM it
            t.record_snapshot(n0, loading, float(second))
            assert t.state_of(n0) == "warming"
        warm = replace(snap("n0", 20), rss=10 * gib, rss_slope=0.0, mem_free=14 * gib)
        t.record_snapshot(n0, warm, 41.0)
        assert t.state_of(n0) == "ready" and "n0" in names(t, 41.0)
        # A real leak once warm is still drained.
        leak = replace(warm, seq=21, rss_slope=float(slope))
        t.record_snapshot(n0, leak, 42.0)
        assert t.state_of(n0) == "leaking"
    lines = [r.getMessage() for r in caplog.records if "memory" in r.getMessage()]
    assert len(lines) == 1 and "draining" in lines[0], lines  # none while it warmed


def test_failures_of_tries_under_way_do_not_eject_an_ejected_node_again() -> None:
    """A crash with many streams open: every one fails after the ejection. Each fifth
    re-ejected it, ever longer (30, 60, 90, 120 s for 20 streams)."""
    t = table(4, outlier=OutlierConfig(consecutive_failures=5, base_ejection_time=30))
    n0 = t.nodes["n0"]
    for _ in range(20):
        t.record_result(n0, False, None, None, 1.0)
    assert (n0.times_ejected, n0.ejected_until) == (1, 31.0)
    assert n0.failures == 20  # counted all the same


def test_the_ejection_penalty_eases_while_a_node_stays_back() -> None:
    """As Envoy: each base_ejection_time a node stays back without an ejection, its next one
    is a step shorter; the count only grew, so bursts days apart ended in the longest."""
    t = table(4, outlier=OutlierConfig(consecutive_failures=2, base_ejection_time=10))
    n0 = t.nodes["n0"]
    for now in (1.0, 20.0):  # ejected twice: out 10 s, then 20 s
        t.tick(now)
        t.record_result(n0, False, None, None, now)
        t.record_result(n0, False, None, None, now)
    assert (n0.times_ejected, n0.ejected_until) == (2, 40.0)
    t.tick(40.0)  # back
    t.record_result(n0, True, None, None, 45.0)
    assert n0.times_ejected == 2  # not back long enough
    t.record_result(n0, True, None, None, 50.0)
    assert n0.times_ejected == 1
    t.record_result(n0, True, None, None, 55.0)
    assert n0.times_ejected == 1  # a step each base_ejection_time, not each success
    t.record_result(n0, True, None, None, 60.0)
    assert n0.times_ejected == 0
    t.record_result(n0, False, None, None, 61.0)
    t.record_result(n0, False, None, None, 61.0)
    assert n0.ejected_until == 71.0  # the base time again


def test_a_draining_node_stays_draining_when_its_sidecar_goes_quiet(snap: MakeSnapshot) -> None:
    """Its pod terminating, the sidecar stops answering mid-drain while the model server still
    answers health checks: once the snapshot went stale the node was "ready" again, and new
    requests went to a node told to drain. A new snapshot that is not draining clears it."""
    t = table(stale_after=5.0)
    n1 = t.nodes["n1"]
    t.record_snapshot(n1, snap("n1", 1, draining=True, running=0), 1.0)
    assert names(t, 2.0) == {"n0", "n2"}
    t.record_health(n1, True, "200 (model server)", 20.0)
    assert names(t, 20.0) == {"n0", "n2"}  # stale, still draining
    assert t.state_of(n1) == "draining"
    t.record_snapshot(n1, snap("n1", 2, running=0), 21.0)  # back, not draining
    assert names(t, 21.0) == {"n0", "n1", "n2"}


def test_without_health_checks_only_joiners_ramp_up() -> None:
    """Slow start is for nodes that join or recover: with health checks off, the starting
    cluster began at a tenth of its share too."""
    t = table(slow_start=10.0, health=HealthConfig(enabled=False))
    t.tick(0.5)
    assert {n.view.ramp for n in t.nodes.values()} == {1.0}
    t.settled = True  # the first round of evidence is in
    late = t.add(NodeConfig(name="late", url="http://127.0.0.1:9100", models=("m",)))
    t.tick(0.5)
    assert late.view.ramp == 0.1


def test_discovery_applies_a_reloaded_config_to_the_nodes_it_keeps() -> None:
    """A reload that changed discovery's models or sidecar port left every current node on the
    old config until its pod went away: its models stayed, its snapshots came from nowhere."""
    t = table(2)
    n0, n1 = t.nodes["n0"], t.nodes["n1"]
    n0.requests = n1.requests = 42
    t.replace_members(
        [
            NodeConfig(name="n0", url="http://127.0.0.1:9000", models=("m", "m2")),
            NodeConfig(name="n1", url="http://127.0.0.1:9001", models=("m",), sidecar="http://s:9"),
        ]
    )
    assert t.nodes["n0"] is n0 and n0.requests == 42  # same server: kept, models follow
    assert n0.models == {"m", "m2"} and n0.view.models == {"m", "m2"}
    assert t.nodes["n1"] is not n1 and t.nodes["n1"].requests == 0  # another sidecar: afresh
    assert t.nodes["n1"].config.sidecar == "http://s:9"


def test_a_model_whose_every_node_is_ejected_keeps_those_whose_health_passes() -> None:
    # Envoy's panic routing: a one-node model was a 503 (or its fallback) for the whole
    # ejection, 30 s and more, after five failures in a row.
    t = table(1, outlier=OutlierConfig(consecutive_failures=2, base_ejection_time=30))
    n0 = t.nodes["n0"]
    for _ in range(2):
        t.record_result(n0, False, None, None, 1.0)
    assert n0.ejected_until == 31.0 and t.state_of(n0) == "ejected"
    assert names(t, 2.0) == {"n0"}  # out, but the model has nothing else
    t.record_health(n0, False, "down", 3.0)
    t.record_health(n0, False, "down", 4.0)
    assert names(t, 4.0) == set()  # unhealthy too: not kept


def test_an_ejected_node_that_names_no_model_is_kept_when_nothing_else_serves() -> None:
    # Panic routing was built from the nodes' models: a node that names none (a valid config)
    # was a 503 for every request for the whole ejection.
    nodes = (NodeConfig(name="any", url="http://127.0.0.1:9000"),)
    clock = Clock()
    config = Config(nodes=nodes, outlier=OutlierConfig(consecutive_failures=2))
    t = NodeTable(config, clock=clock)
    node = t.nodes["any"]
    t.record_health(node, True, "ok", 0.0)
    for _ in range(2):
        t.record_result(node, False, None, None, 1.0)
    clock.now = 2.0
    assert node.ejected_until == 31.0 and t.state_of(node) == "ejected"
    assert [v.name for v in t.candidates("m") or ()] == ["any"] and t.serving(node)


def test_the_ejection_cap_holds_for_each_model_not_for_the_models_together() -> None:
    # m1 on a and b, m2 on b to e: the pool of b was all five nodes, and at 50% both of m1's
    # nodes went.
    served = {"a": ("m1",), "b": ("m1", "m2"), "c": ("m2",), "d": ("m2",), "e": ("m2",)}
    nodes = tuple(
        NodeConfig(name=n, url=f"http://127.0.0.1:{9000 + i}", models=m)
        for i, (n, m) in enumerate(served.items())
    )
    config = OutlierConfig(consecutive_failures=2, max_ejection_percent=50)
    clock = Clock()
    t = NodeTable(Config(nodes=nodes, outlier=config), clock=clock)
    clock.now = 1.0
    for node in t.nodes.values():
        t.record_health(node, True, "ok", 0.0)
    for name in ("a", "a", "b", "b"):
        t.record_result(t.nodes[name], False, None, None, 1.0)
    assert t.nodes["a"].ejected_until and not t.nodes["b"].ejected_until
    assert [v.name for v in t.candidates("m1") or ()] == ["b"]


def test_an_ejected_node_stays_out_while_its_model_has_another() -> None:
    t = table(2, outlier=OutlierConfig(consecutive_failures=2, base_ejection_time=30))
    n0 = t.nodes["n0"]
    for _ in range(2):
        t.record_result(n0, False, None, None, 1.0)
    assert names(t, 2.0) == {"n1"}


def test_a_node_a_reload_brings_in_follows_the_reloads_health_setting() -> None:
    # Built under the old config: a reload that turned health checks off left its newcomer
    # "unknown" for good (nothing checks it), and one that turned them on let a newcomer in
    # as ready, unchecked.
    t = table(2)  # health checks on
    off = Config(
        nodes=(
            *t._config.nodes,
            NodeConfig(name="new", url="http://127.0.0.1:9100", models=("m",)),
        ),
        health=HealthConfig(enabled=False),
    )
    (joiner,) = t.newcomers(off)
    assert joiner.health_ok is True
    t.reconfigure(off, [joiner])
    assert [n.name for n in t.candidates("m") or ()] == ["n0", "n1", "new"]
    on = Config(
        nodes=(*off.nodes, NodeConfig(name="other", url="http://127.0.0.1:9101", models=("m",)))
    )
    (checked,) = t.newcomers(on)
    assert checked.health_ok is None  # for the reload's health round to decide


def test_a_node_drained_for_a_leak_is_back_once_a_reload_turns_the_projection_off(
    snap: MakeSnapshot,
) -> None:
    # An operator who saw a false positive and set drain_before_oom = 0: the node stayed
    # "leaking" until its model server restarted.
    from dataclasses import replace

    t = table(outlier=OutlierConfig(drain_before_oom=300.0))
    n0 = t.nodes["n0"]
    growing = replace(snap("n0", 1), rss=2**30, rss_slope=10 * 2**20, mem_free=1000 * 2**20)
    t.record_snapshot(n0, growing, 1.0)
    assert t.state_of(n0) == "leaking"
    t.reconfigure(replace(t._config, outlier=OutlierConfig(drain_before_oom=0.0)))
    assert t.state_of(n0) == "ready" and "n0" in names(t, 1.0)
    # Any change of the projection lets fresh snapshots decide again: a mark made under 300 s
    # held the node out under 60 s (its RSS, drained, never fell) until a restart.
    t.reconfigure(replace(t._config, outlier=OutlierConfig(drain_before_oom=300.0)))
    t.record_snapshot(n0, replace(growing, seq=2), 2.0)
    assert t.state_of(n0) == "leaking"
    t.reconfigure(replace(t._config, outlier=OutlierConfig(drain_before_oom=60.0)))
    assert t.state_of(n0) == "ready"  # 100 s to its limit: not within 60
