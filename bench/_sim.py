"""``promptlb-bench sim``: the scenario through the discrete-event simulator, strategy by strategy.

Every strategy replays the same arrival trace on the same emulated nodes (see `_simcore` for the
model). ``round_robin`` and the ``perfect`` bound always run, since the report gives each
strategy's p99 as a ratio to both. The table goes to stdout and the numbers, with the commit and
every parameter, to ``<out>/sim-<scenario>.json`` (``-n<N>`` appended when ``--nodes`` rescaled
the cluster, so the scaled run does not overwrite the scenario's own). Above 64 nodes the JSON
gives node classes (the scenario's original nodes) rather than every node.

Latency percentiles are over the requests that succeeded; the error rate counts the rest.
Throughput is the completions within the trace's window over its length (``throughput_rps``);
goodput over the span is the successes over the window or, past it, to the last completion
(``goodput_over_span_rps``). Utilisation is slot-seconds of work within the trace's window over
slots x window.
"""
# Over 350 lines: the sim command and its report; the model itself is in the _sim* modules.

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from promptlb.middleware._strategies import DEFAULT_STRATEGY
from promptlb.shared import ConfigError, parse_duration

from ._report import FAILED_AS_S, RESULTS, environment
from ._scenario import Scenario, load_scenario, scaled
from ._simcache import (
    CACHE_BASELINES,
    cache_lines,
    cache_ratios,
    cache_targets,
    cache_verdicts,
    plot_cache,
)
from ._simcore import PERFECT, SIM_STRATEGIES, SimParams, SimResult, simulate
from ._simparams import AFFINITY, SHARED
from ._simprompt import prefix_load, prepare, read
from ._stats import jain, percentile

DEFAULT_SHARED = DEFAULT_STRATEGY + SHARED

__all__ = [
    "by_class",
    "run_sim",
    "scale_nodes",
    "summarise",
    "trace_scenario",
]

BASELINES = ("round_robin", PERFECT)
# The scenarios' [targets] speak of their own nodes and duration at 8 replicas and 1 s staleness.
TARGET_REPLICAS = 8
TARGET_STALENESS_S = 1.0
TARGET_RUN = "the scenario as written at 8 replicas and 1 s staleness"
_PER_NODE_ROWS = 16  # beyond this many nodes the table shows node classes ...
_PER_NODE_JSON = 64  # ... and beyond this many, the JSON too (1,000 nodes' rows are ~1 MB)


def scale_nodes(scenario: Scenario, count: int | None) -> tuple[Scenario, list[str]]:
    """The scenario on ``count`` nodes: its node list cycled (copies named ``NAME~K``, faults
    and all), and a fixed ``rate`` scaled by the capacity ratio so the load stays the same (a
    ``load`` follows capacity by itself). Also returns each node's class: the original's name."""
    specs = scenario.nodes
    if count is None or count == len(specs):
        return scenario, [s.name for s in specs]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError("nodes", count, "an integer >= 1")
    nodes = []
    classes = []
    for i in range(count):
        spec = specs[i % len(specs)]
        copy = i // len(specs)
        nodes.append(
            dataclasses.replace(spec, name=spec.name if copy == 0 else f"{spec.name}~{copy}")
        )
        classes.append(spec.name)
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ConfigError("nodes", count, "a count whose copies' names do not clash")
    scaled = dataclasses.replace(scenario, nodes=tuple(nodes))
    if scenario.workload.rate is not None:
        rate = scenario.workload.rate * scaled.capacity() / scenario.capacity()
        scaled = dataclasses.replace(
            scaled, workload=dataclasses.replace(scenario.workload, rate=rate)
        )
    return scaled, classes


def trace_scenario(scenario: Scenario) -> Scenario:
    """The same scenario with its base rate fixed as a number.

    ``Scenario.base_rate`` under ``load`` re-estimates capacity (thousands of draws) each time
    it is read, and ``arrivals()`` reads it per arrival: minutes for a 1,000-node trace. Fixing
    the very same float as ``rate`` leaves the trace identical, draw for draw."""
    if scenario.workload.rate is not None:
        return scenario
    rate = scenario.base_rate
    return dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, rate=rate, load=None)
    )


def summarise(result: SimResult, classes: Sequence[str] | None = None) -> dict[str, Any]:
    """One strategy's row of the report (ratios are added once every strategy has run)."""
    ordered = sorted(result.latencies)
    ttfts = sorted(result.ttfts)
    ok = len(ordered)
    duration = result.duration
    tries = sum(result.dispatched) or 1
    utilisation = [
        busy / (slots * duration) if duration > 0 else 0.0
        for busy, slots in zip(result.busy, result.slots, strict=True)
    ]
    nodes = [
        {
            "name": name,
            "class": cls,
            "slots": slots,
            "tries": tried,
            "served": served,
            "share": tried / tries,
            "utilisation": util,
            "max_depth": depth,
        }
        for name, cls, slots, tried, served, util, depth in zip(
            result.node_names,
            classes or result.node_names,
            result.slots,
            result.dispatched,
            result.served,
            utilisation,
            result.max_depth,
            strict=True,
        )
    ]
    return {
        "strategy": result.strategy,
        "requests": result.requests,
        "ok": ok,
        "p50_s": percentile(ordered, 50),
        "p90_s": percentile(ordered, 90),
        "p99_s": percentile(ordered, 99),
        # As the live report's latency_with_failures: a failed request counts as the client's
        # timeout, so a strategy that fails its slowest requests does not read faster than one
        # that serves them late (the percentiles above are over the successes).
        "p99_with_failures_s": percentile([*ordered, *[FAILED_AS_S] * result.failed], 99),
        "mean_s": sum(ordered) / ok if ok else float("nan"),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        # Failures counted as the client's timeout, as the p99 above: the cache targets are
        # judged on it (over successes, a router failing its slowest read as the fastest).
        "ttft_p90_with_failures_s": percentile([*ttfts, *[FAILED_AS_S] * result.failed], 90),
        "ttft_p99_s": percentile(ttfts, 99),
        # Cached prompt tokens over prompt tokens, as the emulators count them (None when the
        # requests carry no prompt, so no cache was asked).
        "hit_rate": result.hit_tokens / result.query_tokens if result.query_tokens else None,
        "mean_wait_s": sum(result.waits) / ok if ok else float("nan"),
        # As the live report counts: completions within the trace's window, over its length
        # (successes over the whole span was the live goodput_over_span_rps under this name:
        # one straggler halved a row, and put predictive above the bound on hetero-8).
        "throughput_rps": result.in_window / duration if duration > 0 else 0.0,
        # Over the window or past it to the last end, as the live report's span.
        "goodput_over_span_rps": ok / span if (span := max(duration, result.makespan)) else 0.0,
        "error_rate": result.failed / result.requests if result.requests else 0.0,
        "errors": result.errors,
        "retries": result.retries,
        "ejections": result.ejections,
        "jain_utilisation": jain(utilisation),
        "wall_s": result.wall_s,
        "events": result.events,
        "nodes": nodes,
    }


def _strategies(raw: str, prompted: bool = False) -> list[str]:
    names: list[str] = []
    for name in (part.strip() for part in raw.split(",")):
        if not name:
            continue
        if name not in SIM_STRATEGIES:
            raise ConfigError("strategies", name, "one of " + ", ".join(SIM_STRATEGIES))
        if name not in names:
            names.append(name)
    # With prompts, the default both as replicas run it alone and sharing through Redis.
    for name in BASELINES + ((DEFAULT_SHARED, *CACHE_BASELINES) if prompted else ()):
        if name not in names:
            names.append(name)
    return names


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or not base > 0:  # no successes, no ratio
        return None
    return value / base


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or value != value else format(value, spec)


def _print_table(header: str, rows: list[dict[str, Any]], wall_total: float) -> None:
    print(header)
    cols = (
        f"{'strategy':<19} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'+fail':>7} {'mean s':>7} "
        f"{'req/s':>8} "
        f"{'err %':>6} {'jain':>5} {'p99/perf':>8} {'p99/rr':>7} {'wall s':>7}"
    )
    print(cols)
    print("-" * len(cols))
    for row in rows:
        print(
            f"{row['strategy']:<19} {_fmt(row['p50_s']):>7} {_fmt(row['p90_s']):>7} "
            f"{_fmt(row['p99_s']):>7} {_fmt(row['p99_with_failures_s']):>7} "
            f"{_fmt(row['mean_s']):>7} "
            f"{_fmt(row['throughput_rps'], '.1f'):>8} {100 * row['error_rate']:>6.2f} "
            f"{row['jain_utilisation']:>5.3f} {_fmt(row['p99_vs_perfect'], '.2f'):>8} "
            f"{_fmt(row['p99_vs_round_robin'], '.2f'):>7} {row['wall_s']:>7.2f}"
        )
    print(f"wall time, all strategies: {wall_total:.2f} s")


def by_class(nodes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-node rows summed up per node class: total share, utilisation's mean and range."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for node in nodes:
        groups.setdefault(node["class"], []).append(node)
    out = []
    for cls, members in groups.items():
        utils = [n["utilisation"] for n in members]
        out.append(
            {
                "class": cls,
                "nodes": len(members),
                "slots": members[0]["slots"],
                "tries": sum(n["tries"] for n in members),
                "served": sum(n["served"] for n in members),
                "share": sum(n["share"] for n in members),
                "utilisation_mean": sum(utils) / len(utils),
                "utilisation_min": min(utils),
                "utilisation_max": max(utils),
                "max_depth": max(n["max_depth"] for n in members),
            }
        )
    return out


def _print_nodes(rows: list[dict[str, Any]]) -> None:
    """Per node (or per node class, for big clusters): share of requests / utilisation."""
    first = rows[0]["nodes"]
    per_class = len(first) > _PER_NODE_ROWS
    keys: list[str] = []
    for node in first:
        key = node["class"] if per_class else node["name"]
        if key not in keys:
            keys.append(key)
    width = max(12, *(len(k) for k in keys))
    head = f"{'class' if per_class else 'node':<{width}} {'slots':>5}"
    head += "".join(f" {row['strategy'][:15]:>15}" for row in rows)
    print(
        "share of tries / utilisation"
        + (" (share: the class's total; utilisation: its mean)" if per_class else "")
    )
    print(head)
    for key in keys:
        line = ""
        slots = 0
        for row in rows:
            members = [n for n in row["nodes"] if (n["class"] if per_class else n["name"]) == key]
            slots = members[0]["slots"]
            share = sum(n["share"] for n in members)
            util = sum(n["utilisation"] for n in members) / len(members)
            line += f" {100 * share:>6.2f}%/{100 * util:>5.1f}%"
        print(f"{key:<{width}} {slots:>5}{line}")


def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    """Run the ``sim`` subcommand; returns the report it wrote."""
    scenario = load_scenario(args.scenario)
    time_scale = 1.0
    if getattr(args, "duration", None) is not None:
        duration = parse_duration("duration", args.duration)
        if duration <= 0:
            raise ConfigError("duration", args.duration, "> 0")
        # As the live runner: faults and bursts keep their place in the story.
        scenario, time_scale = scaled(scenario, duration)
    node_count = getattr(args, "nodes", None)
    original_nodes = len(scenario.nodes)
    scenario, classes = scale_nodes(scenario, node_count)
    params = SimParams(
        replicas=getattr(args, "replicas", 8),
        staleness=parse_duration("staleness", getattr(args, "staleness", "1s")),
        seed=scenario.seed,
        model=scenario.model,
    )
    capacity = scenario.capacity()
    traced = trace_scenario(scenario)
    started = time.perf_counter()
    arrivals = traced.arrivals()
    prompted = any(a.messages for a in arrivals)
    # Read once, by the gateway's and the engine's rules, for every strategy's run.
    prepared = prepare(arrivals, scenario.model) if prompted else None
    reads = read(arrivals, scenario.model)
    trace_s = time.perf_counter() - started
    names = _strategies(getattr(args, "strategies", DEFAULT_STRATEGY), prompted)
    rows: list[dict[str, Any]] = []
    ttfts: dict[str, list[float]] = {}
    kv_use: dict[str, list[float]] = {}
    for name in names:
        result = simulate(
            scenario.nodes,
            arrivals,
            name,
            duration=scenario.duration,
            params=params,
            options=scenario.strategy_options.get(name.removesuffix(AFFINITY).removesuffix(SHARED)),
            prepared=prepared,
            reads=reads,
        )
        if name == DEFAULT_STRATEGY:
            kv_use = result.kv_use
        rows.append(summarise(result, classes))
        ttfts[name] = list(result.ttfts)
    by_name = {row["strategy"]: row for row in rows}
    for row in rows:
        # Failures counted (as the live ratios are): over successes alone, a strategy that
        # fails its slowest requests read as faster than one that serves them late.
        mine = row["p99_with_failures_s"]
        row["p99_vs_perfect"] = _ratio(mine, by_name[PERFECT]["p99_with_failures_s"])
        row["p99_vs_round_robin"] = _ratio(mine, by_name["round_robin"]["p99_with_failures_s"])
    if prompted:
        cache_ratios(rows)
    wall_total = time.perf_counter() - started
    env = environment()  # the one place that asks git what was measured
    commit, dirty = env["commit"], env["dirty"]
    resized = len(scenario.nodes) != original_nodes
    label = f"{scenario.name}-n{len(scenario.nodes)}" if resized else scenario.name
    applies = (
        not resized
        and time_scale == 1.0
        and params.replicas == TARGET_REPLICAS
        and params.staleness == TARGET_STALENESS_S
    )
    report: dict[str, Any] = {
        "benchmark": "sim",
        "scenario": scenario.name,
        "label": label,
        "commit": commit,
        "dirty": dirty,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "parameters": {
            "nodes": len(scenario.nodes),
            "replicas": params.replicas,
            "staleness_s": params.staleness,
            "duration_s": scenario.duration,
            "fault_time_scale": round(time_scale, 4),
            "seed": scenario.seed,
            "rate_rps": traced.workload.rate,
            "load": scenario.workload.load,
            "offered_load": (traced.workload.rate or 0.0) / capacity if capacity else None,
            "capacity_rps": capacity,
            "requests": len(arrivals),
            # Every knob of the middleware and client model (see _simcore), by its name there.
            "model": {k: v for k, v in dataclasses.asdict(params).items() if k != "model"},
            "strategies": names,
        },
        "wall_s": {"trace": trace_s, "total": wall_total},
        "targets": _targets(by_name, scenario.targets, applies=applies),
        "results": rows,
    }
    if prompted:
        assert prepared is not None
        report["parameters"]["prefix_load"] = prefix_load(
            scenario.nodes, arrivals, prepared, scenario.duration
        )
        report["cache_targets"] = cache_targets(rows, scenario.targets, applies)
        # How full each node's KV cache is under the default (cached blocks included), a reading
        # a second (the PNG's third panel).
        report["kv_use"] = {"strategy": DEFAULT_STRATEGY, "every_s": 1.0, "nodes": kv_use}
        report["cache_targets_shared"] = cache_targets(
            rows, scenario.targets, applies, DEFAULT_SHARED
        )
    header = (
        f"sim {label}: {len(scenario.nodes)} nodes, {params.replicas} replicas, staleness "
        f"{params.staleness:g}s, {len(arrivals)} requests in {scenario.duration:g}s "
        f"({len(arrivals) / scenario.duration:.1f}/s, "
        f"{100 * (traced.workload.rate or 0.0) / capacity:.0f}% of capacity), commit {commit}"
        f"{'+dirty' if dirty else ''}"
    )
    _print_table(header, rows, wall_total)
    _print_nodes(rows)
    for line in _target_lines(report["targets"]):
        print(line)
    if prompted:
        for line in cache_lines(rows, report["cache_targets"]):
            print(line)
        for line in cache_verdicts(report["cache_targets_shared"]):
            print(line)
    if len(scenario.nodes) > _PER_NODE_JSON:
        report["per_node"] = f"summed up per node class above {_PER_NODE_JSON} nodes"
        for row in rows:
            row["node_classes"] = by_class(row.pop("nodes"))
    out = Path(args.out) if getattr(args, "out", None) else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sim-{label}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean(report), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")
    if prompted and not getattr(args, "no_plot", False):
        png = path.with_suffix(".png")
        hits = {row["strategy"]: row["hit_rate"] for row in rows}
        series = {n: [(float(i), v) for i, v in enumerate(vs)] for n, vs in kv_use.items()}
        title = f"{header.split(':')[0]}, {params.replicas} replicas"
        plot_cache(png, title, ttfts, hits, series, DEFAULT_STRATEGY)
        print(f"wrote {png}")
    return report


def _clean(value: Any) -> Any:
    """NaN (a strategy with no success has no percentiles) as JSON null, not invalid JSON."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _targets(
    by_name: dict[str, dict[str, Any]], goals: Mapping[str, float], applies: bool
) -> dict[str, Any]:
    """The default strategy's p99 ratios, each with the scenario's target for it (``goals``)
    when it sets one and the run is the one the targets speak of (``applies``)."""
    row = by_name.get(DEFAULT_STRATEGY)
    if row is None:
        return {"strategy": DEFAULT_STRATEGY, "ran": False}
    out: dict[str, Any] = {"strategy": DEFAULT_STRATEGY, "ran": True, "applies": applies}
    for key in ("p99_vs_round_robin", "p99_vs_perfect"):
        value = row[key]
        out[key] = value
        goal = goals.get(key)
        if goal is not None and applies:
            out[f"{key}_target"] = goal
            out[f"{key}_met"] = None if value is None else value <= goal
    return out


def _target_lines(targets: dict[str, Any]) -> list[str]:
    if not targets.get("ran"):
        return [f"targets: {targets['strategy']} (the default strategy) was not run"]
    lines = []
    for key in ("p99_vs_round_robin", "p99_vs_perfect"):
        value = _fmt(targets[key], ".2f")
        if f"{key}_target" in targets:
            met = targets[f"{key}_met"]
            verdict = "n/a" if met is None else ("met" if met else "MISSED")
            tail = f"(<= {targets[f'{key}_target']}x): {verdict}"
        elif targets["applies"]:
            tail = "(no target on this scenario)"
        else:
            tail = f"(targets are set for {TARGET_RUN}, not this run)"
        lines.append(f"{targets['strategy']} {key.replace('_', ' ')} = {value}x {tail}")
    return lines
