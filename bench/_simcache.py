"""The simulator's report on prefix caching, for scenarios whose requests carry their prompt:
per strategy TTFT and hit rate (cached prompt tokens over prompt tokens, as the emulators'
counters give it), their ratios to round robin, to the default strategy under ``[affinity]``
and to the oracle, the scenario's cache targets, and a PNG (TTFT CDF, hit rate per strategy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from promptlb.middleware._strategies import DEFAULT_STRATEGY

from ._report import step_cdf
from ._simparams import AFFINITY, ORACLE

__all__ = [
    "CACHE_BASELINES",
    "cache_lines",
    "cache_ratios",
    "cache_targets",
    "cache_verdicts",
    "plot_cache",
]

DEFAULT_AFFINITY = DEFAULT_STRATEGY + AFFINITY
# What the cache report compares every strategy with, beside round robin.
CACHE_BASELINES = (DEFAULT_AFFINITY, ORACLE)
# Target name -> (row key, baseline, True when the ratio must be at least the target). TTFT
# counts failures as the client's timeout, as the p99 targets do: over successes alone, a
# default that fails its slowest requests read as meeting every TTFT target.
_TTFT = "ttft_p90_with_failures_s"
CACHE_TARGETS: Mapping[str, tuple[str, str, bool]] = {
    "ttft_p90_vs_round_robin": (_TTFT, "round_robin", False),
    "ttft_p90_vs_affinity": (_TTFT, DEFAULT_AFFINITY, False),
    "ttft_p90_vs_oracle": (_TTFT, ORACLE, False),
    "hit_rate_vs_oracle": ("hit_rate", ORACLE, True),
}


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or not base > 0:
        return None
    return value / base


def cache_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """Each row's TTFT p90 and hit rate over the baselines' (in place)."""
    by_name = {row["strategy"]: row for row in rows}
    for row in rows:
        for name, (key, base, _) in CACHE_TARGETS.items():
            other = by_name.get(base)
            row[name] = _ratio(row[key], other[key] if other else None)


def cache_targets(
    rows: Sequence[dict[str, Any]],
    goals: Mapping[str, float],
    applies: bool,
    strategy: str = DEFAULT_STRATEGY,
) -> Any:
    """``strategy``'s cache ratios (the default's), each with the scenario's target and
    verdict."""
    row = next((r for r in rows if r["strategy"] == strategy), None)
    if row is None:
        return {"strategy": strategy, "ran": False}
    out: dict[str, Any] = {"strategy": strategy, "ran": True, "applies": applies}
    for name, (_, _, at_least) in CACHE_TARGETS.items():
        value = row.get(name)
        out[name] = value
        goal = goals.get(name)
        if goal is not None and applies:
            out[f"{name}_target"] = goal
            met = None if value is None else (value >= goal if at_least else value <= goal)
            out[f"{name}_met"] = met
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def cache_lines(rows: Sequence[dict[str, Any]], targets: Mapping[str, Any]) -> list[str]:
    head = (
        f"{'strategy':<22} {'ttft p50':>8} {'p90':>7} {'+fail':>7} {'p99':>7} {'hit':>6} "
        f"{'p90/rr':>7} {'p90/aff':>7} {'p90/orc':>7} {'hit/orc':>7}"
    )
    lines = [
        "prefix cache: TTFT in s (+fail: p90 with each failure as 60 s, which the ratios"
        " use), hit rate = cached prompt tokens / prompt tokens",
        head,
    ]
    for row in rows:
        lines.append(
            f"{row['strategy']:<22} {_fmt(row['ttft_p50_s'], '.3f'):>8} "
            f"{_fmt(row['ttft_p90_s'], '.3f'):>7} {_fmt(row.get(_TTFT), '.3f'):>7} "
            f"{_fmt(row['ttft_p99_s'], '.3f'):>7} "
            f"{_fmt(row['hit_rate'], '.3f'):>6} "
            + " ".join(f"{_fmt(row[name], '.2f'):>7}" for name in CACHE_TARGETS)
        )
    return lines + cache_verdicts(targets)


def cache_verdicts(targets: Mapping[str, Any]) -> list[str]:
    """One line per cache target set: the strategy's ratio and whether it meets it."""
    lines: list[str] = []
    if not targets.get("ran"):
        return lines
    for name, (_, _, at_least) in CACHE_TARGETS.items():
        if f"{name}_target" not in targets:
            continue
        met = targets[f"{name}_met"]
        verdict = "n/a" if met is None else ("met" if met else "MISSED")
        sign = ">=" if at_least else "<="
        lines.append(
            f"{targets['strategy']} {name.replace('_', ' ')} = "
            f"{_fmt(targets[name], '.2f')}x ({sign} {targets[f'{name}_target']}x): {verdict}"
        )
    return lines


def plot_cache(
    path: Path,
    title: str,
    ttfts: Mapping[str, Sequence[float]],
    hits: Mapping[str, float | None],
    kv_use: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    kv_of: str = "",
) -> None:
    """TTFT CDF per strategy (left), hit rate per strategy (middle) and, when given, how full
    each node's KV cache is (cached blocks included) over the run under ``kv_of`` (right)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    panels = 3 if kv_use else 2
    ratios = [1.6, 1.0, 1.2][:panels]
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), width_ratios=ratios)
    cdf, bars = axes[0], axes[1]
    for name, values in ttfts.items():
        step_cdf(cdf, [v for v in values if math.isfinite(v) and v > 0], name)  # log axis
    cdf.set_xscale("log")
    cdf.set_xlabel("time to first token (s, log scale)")
    cdf.set_ylabel("share of requests")
    cdf.set_title(title, fontsize=10)
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize=7, loc="lower right")
    names = list(hits)
    bars.barh(names, [hits[n] or 0.0 for n in names])
    bars.set_xlim(0, 1)
    bars.set_xlabel("prefix-cache hit rate (cached prompt tokens / prompt tokens)")
    bars.tick_params(labelsize=7)
    bars.invert_yaxis()
    if kv_use:
        use = axes[2]
        for node, points in kv_use.items():
            use.plot([t for t, _ in points], [v for _, v in points], label=node, linewidth=1)
        use.set_ylim(0, 1.05)
        use.set_xlabel("seconds into the run")
        use.set_ylabel("KV cache filled (cached + held)")
        use.set_title(f"per-node KV cache filled, {kv_of}", fontsize=10)
        use.grid(True, alpha=0.3)
        use.legend(fontsize=6, loc="lower right", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
