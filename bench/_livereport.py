"""The live runner's report: what `_live` played turned into what is read. Per run its summary
(latency, utilisation, hit rate, crashes, node states, KV use), the default's targets against
round robin and the best LiteLLM router, the prefix-cache rows against the oracle, the JSON,
the PNGs and the lines printed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from promptlb.middleware._strategies import DEFAULT_STRATEGY

from ._loadgen import Result
from ._report import (
    crash_lines,
    crashes,
    environment,
    plot_cluster,
    summarize,
    table,
    write_json,
)
from ._scenario import Scenario
from ._simcache import cache_lines, cache_ratios, cache_targets, cache_verdicts, plot_cache
from ._simparams import SHARED

__all__ = ["Run", "build_report", "live_cache", "publish", "target_lines", "targets"]


@dataclass
class Run:
    target: str
    kind: str
    strategy: str
    results: list[Result]
    faults: list[dict[str, Any]]
    # Our gateways only: per node, its state's changes as ``[t, state]`` on the run's clock.
    states: dict[str, list[list[Any]]] | None = None
    # Scenarios with prompts: per node, how full its KV cache is (cached blocks included) as
    # ``[t, filled]`` once a second.
    kv_use: dict[str, list[list[float]]] | None = None
    # ``X+shared`` runs: how late the replicas learnt each other's records (`share_lag`).
    share_lag: dict[str, Any] | None = None


def build_report(
    scenario: Scenario,
    requests: int,
    runs: Mapping[str, Run],
    hits: Mapping[str, float | None],
    *,
    slots: Mapping[str, int],
    settings: Mapping[str, Any],
    missing: Sequence[str],
    failed: Mapping[str, str],
    meta: Mapping[str, Any],
) -> dict[str, Any]:
    """The JSON document of one `promptlb-bench cluster` run."""
    summaries = {
        name: {
            "kind": run.kind,
            "strategy": run.strategy,
            **summarize(run.results, dict(slots), scenario.duration),
            "hit_rate": hits.get(name),  # from the emulators' counters; None without prompts
            "faults_applied": run.faults,
            # Per crash: requests lost at it, and (our gateways) whether the node was drained
            # for its leak before it; then every node state change seen.
            "crashes": crashes(run.results, run.faults, run.states),
            "node_states": run.states,
            "kv_use": run.kv_use,
            "index_share_lag": run.share_lag,
        }
        for name, run in runs.items()
    }
    applies = "fault_time_scale" not in meta  # targets hold for the scenario's own duration
    report: dict[str, Any] = {
        "benchmark": "cluster",
        **environment(),
        "scenario": {
            "name": scenario.name,
            "description": scenario.description,
            "duration_s": scenario.duration,
            "seed": scenario.seed,
            "requests": requests,
            "offered_rps": round(requests / scenario.duration, 3),
            "capacity_rps": round(scenario.capacity(), 3),
            "nodes": [
                {
                    "name": n.name,
                    "slots": n.slots,
                    "tokens_per_s": n.tokens_per_s,
                    "ttft_ms": n.ttft_ms,
                    "memory_limit_mb": n.memory_limit_mb,
                    "faults": [dataclasses.asdict(f) for f in n.faults],
                }
                for n in scenario.nodes
            ],
            **meta,
        },
        "settings": dict(settings),
        "missing": list(missing),
        "failed": dict(failed),
        "runs": summaries,
        "targets": targets(summaries, scenario.targets, applies),
    }
    if scenario.workload.prompts is not None:
        report["cache"] = live_cache(summaries, scenario.targets, applies)
    return report


def targets(
    runs: dict[str, dict[str, Any]], goals: Mapping[str, float], applies: bool = True
) -> dict[str, Any]:
    """The default strategy's p99 over round robin's and the best LiteLLM router's, each with
    the scenario's target for it when it sets one (``goals``, its ``[targets]``) and the run is
    the scenario as written (``applies``: not squeezed into a shorter ``--duration``).

    The p99s count failures (``latency_with_failures_ms``, a failed request as the generator's
    timeout) where every run has them: over successes alone, a router that failed a third of
    its requests, its slowest among them, was named the best LiteLLM and could flip a
    verdict. Runs written before that field existed are compared over successes, as then."""
    measure = (
        "latency_with_failures_ms"
        if runs and all("latency_with_failures_ms" in r for r in runs.values())
        else "latency_ms"
    )

    def p99(name: str) -> float | None:
        value = runs.get(name, {}).get(measure, {}).get("p99")
        return float(value) if value is not None else None

    ours = p99(f"promptlb {DEFAULT_STRATEGY}")
    out: dict[str, Any] = {
        "strategy": DEFAULT_STRATEGY,
        "p99_ms": ours,
        "measure": measure,
        "applies": applies,
    }
    rr = p99("promptlb round_robin")
    litellm = {n: p99(n) for n, r in runs.items() if r.get("kind") == "litellm"}
    best = min(((v, n) for n, v in litellm.items() if v is not None), default=None)
    compared: list[tuple[str, float | None, str | None]] = [
        ("vs_round_robin", rr, None),
        ("vs_best_litellm", None, None) if best is None else ("vs_best_litellm", *best),
    ]
    for key, theirs, who in compared:
        if ours is None or not theirs:
            continue
        ratio = ours / theirs
        entry: dict[str, Any] = {"ratio": round(ratio, 3)}
        if who is not None:
            entry["best"] = who
        goal = goals.get(f"p99_{key}")
        if goal is not None and applies:
            entry["target"] = goal
            entry["met"] = ratio <= goal
        out[key] = entry
    return out


def target_lines(t: dict[str, Any]) -> list[str]:
    lines = []
    for key, what in (("vs_round_robin", "round_robin"), ("vs_best_litellm", "best LiteLLM")):
        if key not in t:
            lines.append(f"target: {t['strategy']} vs {what}: not measured in this run")
            continue
        v = t[key]
        who = f" ({v['best']})" if "best" in v else ""
        if "target" in v:
            verdict = f"(<= {v['target']}x): {'met' if v['met'] else 'MISSED'}"
        elif t.get("applies", True):
            verdict = "(no target on this scenario)"
        else:
            verdict = "(targets are set for the scenario's own duration, not this run)"
        p99 = "p99 with failures" if t.get("measure") == "latency_with_failures_ms" else "p99"
        lines.append(f"{t['strategy']} {p99} / {what}{who} = {v['ratio']:.2f}x {verdict}")
    return lines


def live_cache(
    runs: Mapping[str, Mapping[str, Any]], goals: Mapping[str, float], applies: bool
) -> dict[str, Any]:
    """Our runs' and the oracle's TTFT and hit rate with the simulator's ratios and verdicts
    (the oracle's stay empty when it did not run)."""
    rows: list[dict[str, Any]] = []
    for run in runs.values():
        if run["kind"] not in ("promptlb", "oracle"):
            continue
        ttft = {p: run["ttft_ms"][p] for p in ("p50", "p90", "p99")}
        row = {f"ttft_{p}_s": None if v is None else v / 1000 for p, v in ttft.items()}
        # Failures counted where the run recorded them so (runs before 2026-12-08 did not).
        p90 = run.get("ttft_with_failures_ms", run["ttft_ms"])["p90"]
        row["ttft_p90_with_failures_s"] = None if p90 is None else p90 / 1000
        rows.append({"strategy": run["strategy"], **row, "hit_rate": run["hit_rate"]})
    cache_ratios(rows)
    shared = cache_targets(rows, goals, applies, DEFAULT_STRATEGY + SHARED)
    return {
        "rows": rows,
        "targets": cache_targets(rows, goals, applies),
        "targets_shared": shared,
    }


def publish(
    report: dict[str, Any],
    plots: Mapping[str, list[Result]],
    scenario: Scenario,
    out: Path,
    *,
    plot: bool,
) -> None:
    """Write the JSON (and the PNGs unless ``plot`` is off) and print the summary."""
    write_json(out / f"cluster-{scenario.name}.json", report)
    if plot and plots:
        slots = {n.name: n.slots for n in scenario.nodes}
        title = (
            f"{scenario.name} ({scenario.duration:g}s, {report['scenario']['requests']} requests)"
        )
        plot_cluster(out / f"cluster-{scenario.name}.png", title, plots, slots, scenario.duration)
        if "cache" in report:
            ttfts = {
                n: [r.ttft for r in rs if r.ok and r.ttft is not None] for n, rs in plots.items()
            }
            hit = {n: r["hit_rate"] for n, r in report["runs"].items()}
            default = f"promptlb {DEFAULT_STRATEGY}"
            use = report["runs"].get(default, {}).get("kv_use") or {}
            series = {n: [(t, v) for t, v in points] for n, points in use.items()}
            png = out / f"cluster-{scenario.name}-cache.png"
            plot_cache(png, title, ttfts, hit, series, default)
    print(
        f"\n{scenario.name}: commit {report['commit']}, {report['scenario']['requests']} requests"
    )
    print(table(report["runs"]))
    for line in crash_lines(report["runs"]):
        print(line)
    for line in report["missing"]:
        print(line)
    for name, why in report["failed"].items():
        print(f"failed: {name}: {why[:200]}")
    for line in target_lines(report["targets"]):
        print(line)
    if "cache" in report:
        for line in cache_lines(report["cache"]["rows"], report["cache"]["targets"]):
            print(line)
        for line in cache_verdicts(report["cache"].get("targets_shared", {})):
            print(line)
    print(f"wrote {out / f'cluster-{scenario.name}.json'}")
