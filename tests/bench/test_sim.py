"""The simulator: textbook queueing results, the perfect bound, faults, determinism, the CLI.

Every run here has a fixed seed, so every assertion sees the same numbers each time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from promptlb.bench._cli import main
from promptlb.bench._report import FAILED_AS_S
from promptlb.bench._scenario import (
    Arrival,
    Dist,
    Fault,
    NodeSpec,
    PromptClass,
    Scenario,
    Workload,
    load_scenario,
    parse_scenario,
)
from promptlb.bench._sim import by_class, scale_nodes, summarise, trace_scenario
from promptlb.bench._simcore import PERFECT, ServiceFn, SimParams, SimResult, _Sim, simulate
from promptlb.bench._simnode import CRASHED
from promptlb.bench._stats import jain, percentile
from promptlb.middleware._predictive import ServiceModel
from promptlb.middleware._rules import ERROR_FLOOR, ERROR_HALF_LIFE
from promptlb.shared import ConfigError


def _fixed(tokens: int) -> PromptClass:
    return PromptClass(
        name="q",
        share=1.0,
        prompt_tokens=Dist(kind="fixed", mean=1),
        max_tokens=Dist(kind="fixed", mean=tokens),
    )


def _cluster(
    rate: float, nodes: int, duration: float, seed: int, *, slots: int = 1, tokens: int = 10
) -> Scenario:
    """``nodes`` equal nodes serving ``tokens`` at 10 tokens/s: 1 s per request by default."""
    return Scenario(
        name="test",
        duration=duration,
        seed=seed,
        nodes=tuple(
            NodeSpec(name=f"n{i}", slots=slots, tokens_per_s=10.0, ttft_ms=0.0)
            for i in range(nodes)
        ),
        workload=Workload(rate=rate, mix=(_fixed(tokens),)),
    )


def _exponential(mean: float) -> ServiceFn:
    def service(spec: NodeSpec, arrival: Arrival, rng: random.Random) -> float:
        return rng.expovariate(1.0 / mean)

    return service


def _run(
    scenario: Scenario,
    strategy: str,
    *,
    service: ServiceFn | None = None,
    **params: Any,
) -> SimResult:
    return simulate(
        scenario.nodes,
        scenario.arrivals(),
        strategy,
        duration=scenario.duration,
        params=SimParams(seed=scenario.seed, **params),
        service=service,
    )


def _p99(result: SimResult) -> float:
    p99 = percentile(result.latencies, 99)
    assert p99 is not None
    return p99


def _mean(result: SimResult) -> float:
    return sum(result.latencies) / len(result.latencies)


# -- textbook results -------------------------------------------------------------------------
def test_power_of_two_keeps_queues_far_shorter_than_random() -> None:
    """The supermarket model: at 95% load on 50 single-slot nodes, random routing makes each
    node an M/M/1 queue (max queue grows like log of the run), two choices keep it near
    log log n. The real p2c, with one replica, sees every queue exactly through in_flight."""
    scenario = _cluster(rate=0.95 * 50, nodes=50, duration=1200.0, seed=2)
    service = _exponential(1.0)
    # No per-try timeout: it would cut off exactly the long queues being measured.
    at_random = _run(
        scenario,
        "random",
        service=service,
        replicas=1,
        per_try_timeout=math.inf,
        client_timeout=math.inf,
    )
    two = _run(
        scenario,
        "p2c",
        service=service,
        replicas=1,
        per_try_timeout=math.inf,
        client_timeout=math.inf,
    )
    assert at_random.requests > 50_000 and at_random.failed == two.failed == 0
    assert max(two.max_depth) <= max(at_random.max_depth) / 2
    assert sum(two.waits) / two.ok < sum(at_random.waits) / at_random.ok / 2


def test_mm1_mean_wait_matches_the_formula() -> None:
    """M/M/1 with lambda = 5/s and mu = 10/s: the mean wait in the queue is rho / (mu - lambda)
    = 0.1 s. 200,000 customers at rho = 0.5 put the estimate well within 5%."""
    lam, mu = 5.0, 10.0
    scenario = _cluster(rate=lam, nodes=1, duration=200_000 / lam, seed=1)
    result = _run(
        scenario,
        "round_robin",
        service=_exponential(1 / mu),
        replicas=1,
        per_try_timeout=math.inf,
        client_timeout=math.inf,
    )
    assert result.ok > 190_000 and result.failed == 0
    expected = (lam / mu) / (mu - lam)
    assert sum(result.waits) / result.ok == pytest.approx(expected, rel=0.05)
    # Sojourn = wait + service: 1 / (mu - lambda).
    assert _mean(result) == pytest.approx(1 / (mu - lam), rel=0.05)


def test_deterministic_service_is_the_emulators() -> None:
    """One free node: latency is exactly ttft + prompt / prefill + max_tokens / tokens_per_s."""
    node = NodeSpec(name="a", slots=4, tokens_per_s=50.0, ttft_ms=200.0, prefill_tokens_per_s=1000)
    arrivals = [Arrival(1.0, "q", 500, 100), Arrival(50.0, "q", 0, 10)]
    result = simulate([node], arrivals, "round_robin", duration=60.0)
    assert list(result.latencies) == pytest.approx([0.2 + 0.5 + 2.0, 0.2 + 0.2])
    assert result.busy == [pytest.approx(2.7 + 0.4)]


def test_slots_then_fifo_queue() -> None:
    """Two slots, 1 s each: the third request at t=0 waits for the first slot to free."""
    node = NodeSpec(name="a", slots=2, tokens_per_s=10.0, ttft_ms=0.0)
    arrivals = [Arrival(0.0, "q", 1, 10), Arrival(0.0, "q", 1, 10), Arrival(0.1, "q", 1, 10)]
    result = simulate([node], arrivals, "round_robin", duration=5.0)
    assert sorted(result.latencies) == pytest.approx([1.0, 1.0, 1.9])
    assert max(result.max_depth) == 3


# -- the perfect bound ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["hetero-8", "seed-3am"])
def test_perfect_is_never_worse_than_round_robin(name: str) -> None:
    scenario = trace_scenario(load_scenario(name))
    arrivals = scenario.arrivals()
    runs = {
        s: simulate(scenario.nodes, arrivals, s, duration=scenario.duration)
        for s in ("round_robin", PERFECT)
    }
    rr, perfect = runs["round_robin"], runs[PERFECT]
    for q in (50, 90, 99):
        bound, rr_q = percentile(perfect.latencies, q), percentile(rr.latencies, q)
        assert bound is not None and rr_q is not None
        assert bound <= rr_q
    assert _mean(perfect) <= _mean(rr)
    assert perfect.failed <= rr.failed
    # It knows at once when a node is gone: it never sends to one, so retries are only of the
    # tries a crash reset before their first token.
    assert "connect" not in perfect.errors and perfect.retries <= 2


def test_perfect_bounds_every_strategy_on_a_heterogeneous_cluster() -> None:
    scenario = trace_scenario(load_scenario("hetero-8"))
    arrivals = scenario.arrivals()
    bound = _mean(simulate(scenario.nodes, arrivals, PERFECT, duration=scenario.duration))
    for name in ("round_robin", "least_conn", "p2c", "resource", "weighted", "random"):
        result = simulate(scenario.nodes, arrivals, name, duration=scenario.duration)
        assert bound <= _mean(result), name


def test_perfect_avoids_a_node_that_would_be_slower() -> None:
    """A free slow node versus a busy fast one: JSED weighs the wait against the service."""
    fast = NodeSpec(name="fast", slots=1, tokens_per_s=100.0, ttft_ms=0.0)
    slow = NodeSpec(name="slow", slots=1, tokens_per_s=10.0, ttft_ms=0.0)
    # 100 tokens: 1 s on fast, 10 s on slow. The second arrival waits 0.5 s for fast: better.
    arrivals = [Arrival(0.0, "q", 1, 100), Arrival(0.5, "q", 1, 100)]
    result = simulate([fast, slow], arrivals, PERFECT, duration=5.0)
    assert result.served == [2, 0]
    assert sorted(result.latencies) == pytest.approx([1.0, 1.5])


# -- faults -----------------------------------------------------------------------------------
def _two_nodes(faults: tuple[Fault, ...], duration: float = 40.0) -> Scenario:
    scenario = _cluster(rate=4.0, nodes=2, duration=duration, seed=3, slots=4, tokens=5)
    first, second = scenario.nodes
    return dataclasses.replace(scenario, nodes=(first, dataclasses.replace(second, faults=faults)))


def test_a_crash_fails_its_requests_retries_until_detected_then_recovers() -> None:
    scenario = _two_nodes((Fault(at=10.0, kind="crash"), Fault(at=20.0, kind="recover")))
    arrivals = scenario.arrivals()
    result = simulate(scenario.nodes, arrivals, "round_robin", duration=scenario.duration)
    assert result.errors.get("crash", 0) >= 1  # what was running on it at 10 s
    # Sent to it in the detection window (1-2 s at 4/s, half of them to it): retried, and
    # the retry lands on the live node.
    assert 1 <= result.retries <= 8
    assert result.errors.get("connect", 0) == 0
    assert result.ok + result.failed == result.requests
    # After recovery it serves again, ramping up from a tenth of its share.
    assert result.served[1] > 0 and result.served[0] > result.served[1]
    perfect = simulate(scenario.nodes, arrivals, PERFECT, duration=scenario.duration)
    assert "connect" not in perfect.errors
    assert set(perfect.errors) <= {"crash"}  # only what was streaming on it when it died


def test_slow_applies_to_requests_that_reach_the_node_after_it() -> None:
    """As the emulator, which reads its slow factor once per request, on admission."""
    node = NodeSpec(
        name="a",
        slots=1,
        tokens_per_s=10.0,
        ttft_ms=0.0,
        faults=(Fault(at=10.5, kind="slow", value=3.0), Fault(at=30.0, kind="recover")),
    )
    arrivals = [Arrival(t, "q", 1, 10) for t in (0.0, 10.0, 20.0, 40.0)]
    result = simulate([node], arrivals, "round_robin", duration=50.0)
    assert list(result.latencies) == pytest.approx([1.0, 1.0, 3.0, 1.0])


def test_a_lifted_hang_lets_held_requests_go_on() -> None:
    node = NodeSpec(
        name="a",
        slots=1,
        tokens_per_s=10.0,
        ttft_ms=0.0,
        faults=(Fault(at=5.0, kind="hang"), Fault(at=8.0, kind="recover")),
    )
    arrivals = [Arrival(6.0, "q", 1, 10), Arrival(7.0, "q", 1, 10)]
    result = simulate([node], arrivals, "round_robin", duration=10.0)
    assert list(result.latencies) == pytest.approx([3.0, 3.0])  # held to 8 s, then FIFO
    assert result.failed == 0


def test_a_hung_node_times_out_its_new_requests() -> None:
    node = NodeSpec(
        name="a", slots=2, tokens_per_s=10.0, ttft_ms=0.0, faults=(Fault(at=5.0, kind="hang"),)
    )
    arrivals = [Arrival(4.5, "q", 1, 10), Arrival(6.0, "q", 1, 10), Arrival(7.0, "q", 1, 10)]
    result = simulate(
        [node], arrivals, "round_robin", duration=10.0, params=SimParams(per_try_timeout=30)
    )
    assert list(result.latencies) == pytest.approx([1.0])  # already running: it completes
    assert result.errors == {"timeout": 2}
    assert result.makespan == pytest.approx(37.0)


def test_a_request_that_would_wait_past_the_timeout_fails() -> None:
    node = NodeSpec(name="a", slots=1, tokens_per_s=1.0, ttft_ms=0.0)
    arrivals = [Arrival(0.0, "q", 1, 20), Arrival(0.1, "q", 1, 20), Arrival(0.2, "q", 1, 20)]
    result = simulate(
        [node], arrivals, "round_robin", duration=1.0, params=SimParams(per_try_timeout=30)
    )
    assert list(result.latencies) == pytest.approx([20.0, 39.9])
    assert result.errors == {"timeout": 1}


def test_the_client_gives_up_mid_stream() -> None:
    """The load generator's total timeout: a 100 s generation is cut at 60 s, its slot freed."""
    node = NodeSpec(name="a", slots=1, tokens_per_s=1.0, ttft_ms=0.0)
    arrivals = [Arrival(0.0, "q", 1, 100), Arrival(30.0, "q", 1, 5)]
    params = SimParams(per_try_timeout=math.inf)  # the second waits 30 s for its headers
    result = simulate([node], arrivals, "round_robin", duration=2.0, params=params)
    assert result.errors == {"timeout": 1}
    assert list(result.latencies) == pytest.approx([35.0])  # it got the slot at 60 s
    assert result.busy == [pytest.approx(2.0)]  # within the 2 s window: one slot busy


def test_a_hung_node_is_retried_around_and_ejected() -> None:
    """Tries on a hung node time out after 30 s and go to the other node; five failures in a
    row eject it (30 s, then 60 s), so it stops soaking up half the traffic. Each failure is
    only known 30 s after its try was sent, which is why it still gets a good share."""
    scenario = _two_nodes((Fault(at=0.0, kind="hang"),), duration=100.0)
    arrivals = scenario.arrivals()
    params = SimParams(replicas=1)
    result = simulate(scenario.nodes, arrivals, "round_robin", duration=100.0, params=params)
    assert result.failed == 0  # every timed-out try succeeded on the live node
    assert result.ejections >= 1
    assert 30.5 <= max(result.latencies) < 32.0  # 30 s lost, then 0.5 s (and a queue) on a
    never = simulate(
        scenario.nodes,
        arrivals,
        "round_robin",
        duration=100.0,
        params=SimParams(replicas=1, outlier_failures=0),
    )
    assert never.ejections == 0
    assert never.dispatched[1] >= len(arrivals) / 2
    assert result.dispatched[1] < 0.7 * never.dispatched[1]


def test_a_replica_keeps_each_nodes_error_rate_by_the_middlewares_rule() -> None:
    """Failures raise it, answers lower it, time fades it (each refresh, as the node table's
    tick): the numbers of the node table's own test, so that predictive weighs failing nodes
    in the simulator as it does live."""
    scenario = _cluster(rate=1.0, nodes=2, duration=10.0, seed=1)
    params = SimParams(replicas=1, outlier_failures=0)
    sim = _Sim(scenario.nodes, scenario.arrivals(), "predictive", 10.0, params, {}, None)
    replica = sim.replicas[0]
    hurt, ok = replica.views[1], replica.views[0]
    for _ in range(4):
        sim._record(0, 1, ok=False, now=1.0)
    sim._record(0, 0, ok=True, now=1.0)
    rate = 1 - 0.8**4
    assert hurt.error_rate == pytest.approx(rate) and ok.error_rate == 0.0
    sim._refresh(replica, 1.0 + ERROR_HALF_LIFE)
    assert hurt.error_rate == pytest.approx(rate / 2)
    sim._record(0, 1, ok=True, now=1.0 + 2 * ERROR_HALF_LIFE)  # faded to now, then the answer
    assert hurt.error_rate == pytest.approx(rate / 4 * 0.8)
    sim._refresh(replica, 1.0 + 8 * ERROR_HALF_LIFE)
    assert rate / 4 * 0.8 / 64 < ERROR_FLOOR
    assert hurt.error_rate == 0.0


def test_a_runs_tries_move_the_error_rates() -> None:
    """Through the event loop: tries timing out on a hung node raise its rate; answers on the
    other take a rate it started with under the floor, where time alone would not."""
    scenario = _two_nodes((Fault(at=4.0, kind="hang"),), duration=8.0)
    params = SimParams(replicas=1, outlier_failures=0, per_try_timeout=1.0)
    sim = _Sim(scenario.nodes, scenario.arrivals(), "predictive", 8.0, params, {}, None)
    live, hung = sim.replicas[0].views
    live.error_rate = 0.5
    result = sim.run()
    assert result.retries >= 2 and result.failed == 0
    assert hung.error_rate > 0.3
    assert 0.5 * 0.5 ** (8.0 / ERROR_HALF_LIFE) > ERROR_FLOOR  # time alone: 0.16
    assert live.error_rate == 0.0


def test_retries_stay_within_the_budget() -> None:
    scenario = _two_nodes((Fault(at=10.0, kind="crash"),))
    arrivals = scenario.arrivals()
    none = SimParams(budget_min=0, budget_percent=0.0)
    result = simulate(
        scenario.nodes, arrivals, "round_robin", duration=scenario.duration, params=none
    )
    assert result.retries == 0
    assert result.errors.get("connect", 0) >= 1


# -- replicas, staleness, determinism ----------------------------------------------------------
def test_the_simulator_is_deterministic_for_a_seed() -> None:
    scenario = trace_scenario(load_scenario("seed-3am"))
    arrivals = scenario.arrivals()

    def run(seed: int) -> SimResult:
        params = SimParams(replicas=4, staleness=0.5, seed=seed)
        return simulate(scenario.nodes, arrivals, "p2c", duration=scenario.duration, params=params)

    first, again, other = run(3), run(3), run(4)
    assert list(first.latencies) == list(again.latencies)
    assert (first.errors, first.served, first.busy, first.retries) == (
        again.errors,
        again.served,
        again.busy,
        again.retries,
    )
    assert list(first.latencies) != list(other.latencies)


_DIGEST = """
import hashlib
from promptlb.bench._scenario import load_scenario
from promptlb.bench._sim import trace_scenario
from promptlb.bench._simcore import simulate
s = trace_scenario(load_scenario("seed-3am"))
r = simulate(s.nodes, s.arrivals(), "p2c", duration=s.duration)
print(hashlib.sha256(repr((list(r.latencies), r.errors, r.served)).encode()).hexdigest())
"""


def test_the_simulator_does_not_depend_on_hash_seeds() -> None:
    """Two processes with different string-hash seeds give the same run, crash and retries
    included: no outcome may hang on the iteration order of a set of names. (Sets of objects,
    ordered by address, are avoided by construction: see `_Node.active`.)"""
    digests = {
        subprocess.run(
            [sys.executable, "-c", _DIGEST],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(digests) == 1


def test_staleness_and_replicas_hurt_a_load_aware_strategy() -> None:
    """least_conn on one replica with fresh data beats 16 replicas on 5 s old snapshots."""
    scenario = trace_scenario(load_scenario("hetero-8"))
    arrivals = scenario.arrivals()
    fresh = simulate(
        scenario.nodes,
        arrivals,
        "least_conn",
        duration=scenario.duration,
        params=SimParams(replicas=1, staleness=0.0),
    )
    stale = simulate(
        scenario.nodes,
        arrivals,
        "least_conn",
        duration=scenario.duration,
        params=SimParams(replicas=16, staleness=5.0),
    )
    assert _mean(fresh) < _mean(stale)


def test_a_thousand_nodes_and_fifty_replicas_run() -> None:
    scenario, classes = scale_nodes(load_scenario("hetero-8"), 1000)
    scenario = trace_scenario(dataclasses.replace(scenario, duration=1.0))
    arrivals = scenario.arrivals()
    assert len(arrivals) > 4000
    params = SimParams(replicas=50)
    for name in ("p2c", PERFECT):
        result = simulate(scenario.nodes, arrivals, name, duration=1.0, params=params)
        assert result.ok == len(arrivals)
        per_class = by_class(summarise(result, classes)["nodes"])
        assert [c["nodes"] for c in per_class] == [125] * 8
        assert sum(c["share"] for c in per_class) == pytest.approx(1.0)


def test_throughput_counts_completions_within_the_window_as_the_live_report_does() -> None:
    """Successes over the makespan (the live report's goodput_over_span_rps) went under this
    name: the queue left at the window's end drained past it and dragged the row down."""
    # One slot, 1 s a request, 3 a second offered for 10 s: a long queue at the end.
    scenario = _cluster(rate=3.0, nodes=1, duration=10.0, seed=4)
    result = _run(scenario, "round_robin")
    row = summarise(result)
    assert result.makespan > 20.0 and result.in_window <= 11
    assert row["throughput_rps"] == pytest.approx(result.in_window / 10.0)
    assert row["goodput_over_span_rps"] == pytest.approx(result.ok / result.makespan)
    light = summarise(_run(_cluster(rate=0.5, nodes=2, duration=10.0, seed=4), "round_robin"))
    # All done early: over the window, as the live report's span (not the last end's time).
    assert light["goodput_over_span_rps"] == pytest.approx(light["ok"] / 10.0)


def test_bad_parameters_name_their_key() -> None:
    with pytest.raises(ConfigError) as err:
        SimParams(replicas=0)
    assert err.value.key == "replicas"
    with pytest.raises(ConfigError) as err:
        SimParams(staleness=-1.0)
    assert err.value.key == "staleness"
    node = NodeSpec(name="a")
    with pytest.raises(ConfigError) as err:
        simulate([node], [], "fastest", duration=1.0)
    assert err.value.key == "strategy"


# -- scaling and the trace ---------------------------------------------------------------------
def test_scale_nodes_cycles_the_specs_and_keeps_the_load() -> None:
    data = {
        "duration": "10s",
        "workload": {"rate": 10},
        "nodes": [
            {"name": "a", "slots": 4},
            {"name": "b", "slots": 8, "faults": [{"at": 1, "kind": "crash"}]},
        ],
    }
    scenario = parse_scenario(data)
    scaled, classes = scale_nodes(scenario, 5)
    assert [n.name for n in scaled.nodes] == ["a", "b", "a~1", "b~1", "a~2"]
    assert classes == ["a", "b", "a", "b", "a"]
    assert scaled.nodes[3].faults == scenario.nodes[1].faults
    assert scaled.workload.rate == pytest.approx(10 * scaled.capacity() / scenario.capacity())
    assert scale_nodes(scenario, None)[0] is scenario
    with pytest.raises(ConfigError) as err:
        scale_nodes(scenario, 0)
    assert err.value.key == "nodes"


def test_fixing_the_rate_keeps_the_trace_identical() -> None:
    scenario = dataclasses.replace(load_scenario("uniform-4"), duration=2.0)
    assert scenario.workload.load is not None
    fixed = trace_scenario(scenario)
    assert fixed.workload.rate == scenario.base_rate
    assert fixed.arrivals() == scenario.arrivals()


def test_report_helpers() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None  # JSON null, as the live reports
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


# -- the command line --------------------------------------------------------------------------
def test_cli_sim_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["sim", "uniform-4", "--duration", "5s", "--replicas", "2", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "sim-uniform-4.json").read_text())
    assert report["benchmark"] == "sim" and report["scenario"] == "uniform-4"
    assert isinstance(report["commit"], str) and report["commit"]
    params = report["parameters"]
    assert params["replicas"] == 2 and params["duration_s"] == 5.0 and params["nodes"] == 4
    assert params["staleness_s"] == 1.0 and params["requests"] > 0
    rows = {row["strategy"]: row for row in report["results"]}
    assert set(rows) == {
        "round_robin",
        "least_conn",
        "p2c",
        "resource",
        "weighted",
        "predictive",
        "model_aware",
        PERFECT,
    }
    for row in rows.values():
        assert row["ok"] + sum(row["errors"].values()) == params["requests"]
        assert 0 < row["p50_s"] <= row["p90_s"] <= row["p99_s"]
        assert 0 < row["jain_utilisation"] <= 1
        assert len(row["nodes"]) == 4
        assert sum(n["share"] for n in row["nodes"]) == pytest.approx(1.0)
    assert rows[PERFECT]["p99_vs_perfect"] == 1.0
    assert rows["round_robin"]["p99_vs_round_robin"] == 1.0
    assert report["targets"]["strategy"] == "predictive"
    # uniform-4 sets a bound target for itself as written at 8 replicas: not for this run.
    assert report["targets"]["applies"] is False
    assert "p99_vs_perfect_target" not in report["targets"]
    out = capsys.readouterr().out
    assert "p99/perf" in out and "perfect" in out
    assert "(targets are set for the scenario as written at 8 replicas" in out


def test_cli_sim_reports_the_scenarios_targets_where_they_apply(tmp_path: Path) -> None:
    main(["sim", "uniform-4", "--strategies", "predictive", "--out", str(tmp_path)])
    targets = json.loads((tmp_path / "sim-uniform-4.json").read_text())["targets"]
    assert targets["applies"] is True
    assert targets["p99_vs_perfect_target"] == 1.3
    assert targets["p99_vs_perfect_met"] == (targets["p99_vs_perfect"] <= 1.3)
    assert "p99_vs_round_robin_target" not in targets  # uniform-4 sets none vs round robin


def test_cli_sim_scaled_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "uniform-4", "--duration", "1s", "--nodes", "12", "--out", str(tmp_path)]
    main([*argv, "--strategies", "p2c,random"])
    report = json.loads((tmp_path / "sim-uniform-4-n12.json").read_text())
    assert report["parameters"]["nodes"] == 12
    assert [r["strategy"] for r in report["results"]] == ["p2c", "random", "round_robin", PERFECT]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--strategies", "fastest"])
    assert exit_info.value.code == 2
    assert "strategies" in capsys.readouterr().err


@dataclasses.dataclass(frozen=True)
class _Running:
    """What a node's snapshot reads of a running request."""

    start: float
    head: float
    factor: float


def test_a_refresh_reads_the_tokens_per_s_of_a_request_past_its_first_token() -> None:
    """The engine's tokens/s moves when a running request reaches its first token, though no
    count changes: a snapshot kept until the next count change read it too low (often 0)."""
    scenario = _cluster(rate=1.0, nodes=2, duration=10.0, seed=1)
    sim = _Sim(scenario.nodes, [], "predictive", 10.0, SimParams(replicas=1), {}, None)
    node = sim.nodes[0]
    running = _Running(start=0.0, head=1.0, factor=1.0)  # first token at 1 s
    node.active[running] = None  # type: ignore[index]
    node.running, node.cur = 1, None
    replica = sim.replicas[0]
    sim._refresh(replica, 0.5)
    before = replica.views[0].snapshot
    assert before is not None and before.engine is not None and before.engine.tps == 0.0
    sim._refresh(replica, 1.5)  # no event in between
    after = replica.views[0].snapshot
    assert after is not None and after.engine is not None
    assert after.engine.tps == node.spec.tokens_per_s


def test_every_refresh_is_a_new_snapshot_but_a_dead_engine_s_last_word_stands() -> None:
    """Live, each exchange brings a new snapshot, and predictive learns from each
    (`ServiceModel.see`: the others' queue trend decays while the counts stand still); the
    node's interned one, reused while its counts did not move, was read as no news."""
    scenario = _cluster(rate=1.0, nodes=2, duration=10.0, seed=1)
    sim = _Sim(scenario.nodes, [], "predictive", 10.0, SimParams(replicas=1), {}, None)
    replica = sim.replicas[0]
    sim._refresh(replica, 0.5)
    first = replica.views[0].snapshot
    sim._refresh(replica, 1.5)  # nothing happened in between
    second = replica.views[0].snapshot
    assert first is not None and second is not None
    assert second is not first and second == first
    model = ServiceModel()
    model.see(first, 0)
    model.trend, model.others = 4.0, 0
    model.see(second, 0)  # the same counts again: the trend fades
    assert model.trend == pytest.approx(4.0 * 0.7)
    node = sim.nodes[0]
    node.state = CRASHED
    sim._refresh(replica, 2.5)
    assert replica.views[0].snapshot is node.cur  # nothing new from a dead engine
    sim._refresh(replica, 3.5)
    assert replica.views[0].snapshot is node.cur


def test_the_p99_with_failures_counts_each_failure_as_the_live_report_does() -> None:
    """A strategy that fails its slowest requests must not read faster than one that serves
    them late: the live report's latency_with_failures counts a failure as the client's
    timeout, and so does the simulator's row beside its p99 over the successes."""
    node = NodeSpec(name="a", slots=1, tokens_per_s=1.0, ttft_ms=0.0)
    arrivals = [Arrival(0.0, "q", 1, 20), Arrival(0.1, "q", 1, 20), Arrival(0.2, "q", 1, 20)]
    result = simulate(
        [node], arrivals, "round_robin", duration=1.0, params=SimParams(per_try_timeout=30)
    )
    row = summarise(result)
    assert row["p99_s"] < 40.0  # the successes alone: 20 s and 39.9 s
    # 20, 39.9 and the failure at 60 s: the 99th percentile lies 98% of the way to the last.
    assert row["p99_with_failures_s"] == pytest.approx(39.9 + 0.98 * (FAILED_AS_S - 39.9))
    clean = summarise(_run(_cluster(rate=0.5, nodes=2, duration=10.0, seed=4), "round_robin"))
    assert clean["p99_with_failures_s"] == clean["p99_s"]


def test_the_p99_ratios_count_failures_as_the_live_ratios_do(tmp_path: Path) -> None:
    """On seed-3am round robin fails about 6% of its requests: over successes alone its p99
    read 42 s, where its clients waited 60 s for those that failed."""
    main(["sim", "seed-3am", "--strategies", "round_robin,predictive", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "sim-seed-3am.json").read_text())
    rows = {row["strategy"]: row for row in report["results"]}
    rr, mine = rows["round_robin"], rows["predictive"]
    assert rr["error_rate"] > 0.01 and rr["p99_with_failures_s"] > rr["p99_s"]
    assert mine["p99_vs_round_robin"] == pytest.approx(
        mine["p99_with_failures_s"] / rr["p99_with_failures_s"]
    )
    assert report["targets"]["p99_vs_round_robin"] == mine["p99_vs_round_robin"]
