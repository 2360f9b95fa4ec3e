"""What a simulated replica learns of its nodes: health checks and outlier ejection by the
middleware's rules (`NodeTable.record_result`, `record_health`), on virtual time."""

from __future__ import annotations

import pytest
from promptlb.bench._scenario import Arrival, Dist, Fault, NodeSpec, PromptClass, Scenario, Workload
from promptlb.bench._simcore import SimParams, _Sim, simulate
from promptlb.bench._simnode import CRASHED, UP


def _sim(**params: float) -> _Sim:
    mix = PromptClass(
        name="q",
        share=1.0,
        prompt_tokens=Dist(kind="fixed", mean=1),
        max_tokens=Dist(kind="fixed", mean=10),
    )
    scenario = Scenario(
        name="test",
        duration=10.0,
        seed=1,
        nodes=tuple(NodeSpec(name=n, slots=1, tokens_per_s=10.0, ttft_ms=0.0) for n in "ab"),
        workload=Workload(rate=1.0, mix=(mix,)),
    )
    settings = SimParams(replicas=1, **params)  # type: ignore[arg-type]
    return _Sim(scenario.nodes, scenario.arrivals(), "round_robin", 10.0, settings, {}, None)


def _change(sim: _Sim, idx: int, up: bool, now: float) -> None:
    node = sim.nodes[idx]
    node.state = UP if up else CRASHED
    sim._schedule_detection(node, now, up=up)


def _checks(sim: _Sim) -> list[bool]:
    """Run the health checks' pending verdicts in time order; node b's view after each."""
    seen = []
    for key in sorted(sim.detect_at, key=lambda k: k[1]):
        sim._detect(key, key[1])
        seen.append(sim.replicas[0].alive[1])
    return seen


def test_failures_of_tries_under_way_while_ejected_start_no_new_streak() -> None:
    # 20 streams fail as one crash takes them: ejected once. Counted on, the streak stood at
    # 15 when the node came back, and its next single failure ejected it again, for 60 s.
    sim = _sim()
    replica = sim.replicas[0]
    for _ in range(20):
        sim._record(0, 1, ok=False, now=1.0)
    assert replica.ejected[1] and replica.times_ejected[1] == 1
    assert replica.consecutive[1] == 0
    sim._uneject(0, 1, replica.ejected_until[1])
    assert not replica.ejected[1]
    sim._record(0, 1, ok=False, now=40.0)
    assert not replica.ejected[1] and replica.times_ejected[1] == 1
    for _ in range(4):
        sim._record(0, 1, ok=False, now=41.0)
    assert replica.ejected[1] and replica.times_ejected[1] == 2  # five new failures


def test_an_ejection_eases_a_step_for_each_base_time_a_node_stays_back() -> None:
    # As NodeTable.record_result (`_rules.eases`): the count only grew in the simulator, and a
    # node ejected again after a good minute back was out for 60 s where the gateway's is 30.
    sim = _sim()
    replica = sim.replicas[0]
    for _ in range(5):
        sim._record(0, 1, ok=False, now=1.0)
    assert replica.times_ejected[1] == 1 and replica.back_at[1] is None
    sim._uneject(0, 1, 31.0)
    sim._record(0, 1, ok=True, now=50.0)  # back 19 s: not yet
    assert replica.times_ejected[1] == 1
    sim._record(0, 1, ok=True, now=62.0)  # back 31 s: a step shorter
    assert replica.times_ejected[1] == 0
    for _ in range(5):
        sim._record(0, 1, ok=False, now=100.0)
    assert replica.times_ejected[1] == 1 and replica.ejected_until[1] == 130.0


def test_a_node_ejected_then_unhealthy_is_back_once_its_checks_pass() -> None:
    sim = _sim()
    replica = sim.replicas[0]
    for _ in range(5):
        sim._record(0, 1, ok=False, now=1.0)
    assert replica.ejected[1] and replica.ejected_until[1] == pytest.approx(31.0)
    _change(sim, 1, up=False, now=1.0)
    assert _checks(sim) == [False]
    _change(sim, 1, up=True, now=5.0)
    assert _checks(sim) == [True]  # at 7 s: two checks in a row, not at 31 s
    assert not replica.ejected[1] and replica.n_ejected == 0
    assert replica.ejected_until[1] == 0.0
    assert [v.name for v in replica.cands] == ["a", "b"]
    sim._uneject(0, 1, 31.0)  # the ejection's own end finds nothing to do
    assert replica.n_ejected == 0


def test_a_flap_shorter_than_the_threshold_is_never_seen() -> None:
    # Down at 10.0, back at 10.5, checks each second, two in a row to flip: the check at 11
    # passes, so no streak of two failures ever forms. It was marked down at 11 s, up at 12 s,
    # and then ramped from a tenth of its share over 30 s.
    sim = _sim(health_interval=1.0, unhealthy_threshold=2)
    _change(sim, 1, up=False, now=10.0)
    _change(sim, 1, up=True, now=10.5)
    assert _checks(sim) == [True, True]
    assert not sim.replicas[0].ramping
    # A change back before the first check is never seen at all.
    _change(sim, 1, up=False, now=20.0)
    _change(sim, 1, up=True, now=20.2)
    assert _checks(sim) == [True, True]
    # One that holds through the threshold is.
    _change(sim, 1, up=False, now=30.0)
    assert _checks(sim) == [False]


def test_a_slow_fault_without_a_value_doubles_as_it_does_live() -> None:
    node = NodeSpec(
        name="a", slots=1, tokens_per_s=10.0, ttft_ms=0.0, faults=(Fault(at=5.0, kind="slow"),)
    )
    arrivals = [Arrival(0.0, "q", 1, 10), Arrival(10.0, "q", 1, 10)]
    result = simulate([node], arrivals, "round_robin", duration=20.0)
    assert list(result.latencies) == pytest.approx([1.0, 2.0])


def test_a_model_with_no_ready_node_keeps_its_leaking_then_its_healthy_ejected_nodes() -> None:
    """As `NodeTable._rebuild` (Envoy's panic routing): the simulator dropped every ejected or
    drained node, and failed each request ``no_node`` meanwhile, where the live table routes."""
    sim = _sim()
    replica = sim.replicas[0]

    def names() -> list[str]:
        replica.rebuild()
        return [view.name for view in replica.cands]

    replica.leaking[1] = True
    assert names() == ["a"]
    replica.ejected[0] = True
    assert names() == ["b"]  # near its OOM beats ejected
    replica.leaking[1], replica.ejected[1] = False, True
    assert names() == ["a", "b"]  # both ejected, their health checks passing
    replica.alive[0] = False
    assert names() == ["b"]  # an unhealthy node, never
    replica.leaking[1] = True
    assert names() == []  # ejected and leaking: neither list keeps it, as live


def test_a_lone_hung_node_ejected_still_takes_requests() -> None:
    mix = PromptClass(
        name="q",
        share=1.0,
        prompt_tokens=Dist(kind="fixed", mean=1),
        max_tokens=Dist(kind="fixed", mean=5),
    )
    faults = (Fault(at=5.0, kind="hang"), Fault(at=40.0, kind="recover"))
    node = NodeSpec(name="a", slots=4, tokens_per_s=100.0, ttft_ms=0.0, faults=faults)
    scenario = Scenario(
        name="hang", duration=60.0, seed=1, nodes=(node,), workload=Workload(rate=2.0, mix=(mix,))
    )
    params = SimParams(replicas=1, per_try_timeout=2.0)
    result = simulate([node], scenario.arrivals(), "round_robin", duration=60.0, params=params)
    assert result.ejections >= 1
    assert "no_node" not in result.errors  # ejected, yet its model's only node: kept
    assert result.errors.get("timeout", 0) > 0
