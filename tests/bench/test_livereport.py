"""The live runner's report: the default's targets and the prefix-cache rows."""

from __future__ import annotations

import pytest
from promptlb.bench._livecache import hit_rate
from promptlb.bench._livereport import live_cache, target_lines, targets
from promptlb.middleware._strategies import DEFAULT_STRATEGY


def test_targets_compare_the_default_strategy() -> None:
    def run(kind: str, p99: float) -> dict[str, object]:
        return {"kind": kind, "latency_ms": {"p99": p99}}

    runs = {
        "promptlb round_robin": run("promptlb", 1000.0),
        f"promptlb {DEFAULT_STRATEGY}": run("promptlb", 400.0),
        "litellm simple-shuffle": run("litellm", 900.0),
        "litellm least-busy": run("litellm", 600.0),
    }
    goals = {"p99_vs_round_robin": 0.5, "p99_vs_best_litellm": 0.8}
    out = targets(runs, goals)
    assert out["vs_round_robin"] == {"ratio": 0.4, "target": 0.5, "met": True}
    assert out["vs_best_litellm"]["best"] == "litellm least-busy"
    assert out["vs_best_litellm"]["ratio"] == pytest.approx(0.667, abs=1e-3)
    assert out["vs_best_litellm"]["met"] is True
    lines = target_lines(out)
    assert lines[0] == f"{DEFAULT_STRATEGY} p99 / round_robin = 0.40x (<= 0.5x): met"
    # A scenario without targets still reports the ratios, and says there is no target.
    bare = targets(runs, {})
    assert bare["vs_round_robin"] == {"ratio": 0.4}
    assert target_lines(bare)[0].endswith("= 0.40x (no target on this scenario)")
    # A router that was not run is said to be missing, not taken as met.
    alone = targets({f"promptlb {DEFAULT_STRATEGY}": run("promptlb", 400.0)}, goals)
    assert "vs_round_robin" not in alone
    assert target_lines(alone)[1].endswith("vs best LiteLLM: not measured in this run")
    # A run squeezed into a shorter --duration reports the ratios but holds none to the targets.
    short = targets(runs, goals, applies=False)
    assert short["vs_round_robin"] == {"ratio": 0.4}
    assert target_lines(short)[0].endswith(
        "= 0.40x (targets are set for the scenario's own duration, not this run)"
    )


def test_the_best_litellm_router_is_ranked_with_its_failures_counted() -> None:
    # Over successes alone, the router failing a third of its requests (its slowest) read
    # fastest, was named the best, and the default missed a target it meets against the one
    # that answered them all.
    def run(kind: str, p99: float, with_failures: float) -> dict[str, object]:
        return {
            "kind": kind,
            "latency_ms": {"p99": p99},
            "latency_with_failures_ms": {"p99": with_failures},
        }

    runs = {
        "promptlb round_robin": run("promptlb", 20_000.0, 20_000.0),
        f"promptlb {DEFAULT_STRATEGY}": run("promptlb", 9_000.0, 9_000.0),
        "litellm failing": run("litellm", 10_000.0, 60_000.0),
        "litellm steady": run("litellm", 20_000.0, 20_000.0),
    }
    out = targets(runs, {"p99_vs_best_litellm": 0.8})
    assert out["measure"] == "latency_with_failures_ms"
    assert out["vs_best_litellm"] == {
        "ratio": 0.45,
        "best": "litellm steady",
        "target": 0.8,
        "met": True,
    }
    assert target_lines(out)[1] == (
        f"{DEFAULT_STRATEGY} p99 with failures / best LiteLLM (litellm steady) = 0.45x"
        " (<= 0.8x): met"
    )
    # A run written before the field: compared over successes, as then.
    for r in runs.values():
        del r["latency_with_failures_ms"]
    assert targets(runs, {})["vs_best_litellm"]["best"] == "litellm failing"


def test_live_cache_ratios_and_hit_rate() -> None:
    assert hit_rate({"a": (100, 10)}, {"a": (300, 160)}, "a") == 0.75
    assert hit_rate({"a": (5, 0)}, {"a": (5, 0)}, "a") is None
    # A node restarted in between counts what it counted since: summed as they were, its
    # counters' fall cancelled the other node's rise.
    both = {"a": (100, 50), "b": (100, 50)}
    assert hit_rate({"a": (0, 0), "b": (900, 900)}, both, "ab") == 0.5
    # A node that did not answer a reading (or either): no rate, not one over part of the
    # cluster.
    assert hit_rate({"a": (0, 0), "b": (0, 0)}, {"a": (100, 50)}, "ab") is None
    assert hit_rate({"a": (0, 0)}, {"a": (100, 50)}, "ab") is None

    def run(strategy: str, p90: float, hit: float, kind: str = "promptlb") -> dict[str, object]:
        ttft = {"p50": p90 / 2, "p90": p90, "p99": 2 * p90}
        return {"kind": kind, "strategy": strategy, "ttft_ms": ttft, "hit_rate": hit}

    runs = {
        "promptlb round_robin": run("round_robin", 4000, 0.1),
        "promptlb predictive": run("predictive", 800, 0.8),
        "promptlb predictive+affinity": run("predictive+affinity", 2000, 0.6),
        "nginx least_conn": run("least_conn", 100, 0.0, kind="nginx"),
    }
    cache = live_cache(runs, {"ttft_p90_vs_round_robin": 0.25, "ttft_p90_vs_affinity": 0.5}, True)
    t = cache["targets"]
    assert t["ttft_p90_vs_round_robin"] == pytest.approx(0.2)
    assert t["ttft_p90_vs_round_robin_met"] is True
    assert t["ttft_p90_vs_affinity"] == pytest.approx(0.4) and t["ttft_p90_vs_affinity_met"]
    assert t["hit_rate_vs_oracle"] is None  # the oracle did not run
    assert [r["strategy"] for r in cache["rows"]] == [
        "round_robin",
        "predictive",
        "predictive+affinity",
    ]
    runs["oracle"] = run("oracle", 400, 0.9, kind="oracle")
    t = live_cache(runs, {"ttft_p90_vs_oracle": 1.3}, True)["targets"]
    assert t["ttft_p90_vs_oracle"] == pytest.approx(2.0) and t["ttft_p90_vs_oracle_met"] is False
    # A default that fails its slowest requests: over successes its TTFT p90 met the target;
    # counted as the client's 60 s (a run that recorded it so), it does not.
    runs["promptlb predictive"] = {
        **runs["promptlb predictive"],
        "ttft_with_failures_ms": {"p50": 400, "p90": 60_000, "p99": 60_000},
    }
    t = live_cache(runs, {"ttft_p90_vs_round_robin": 0.25}, True)["targets"]
    assert t["ttft_p90_vs_round_robin"] == pytest.approx(15.0)
    assert t["ttft_p90_vs_round_robin_met"] is False
    assert t["hit_rate_vs_oracle"] == pytest.approx(0.8 / 0.9)
