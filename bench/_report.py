"""Statistics, tables, JSON and the PNG of a benchmark run. Pure functions over `Result` lists,
so that the numbers can be tested on known inputs without any process running."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._loadgen import Result
from ._stats import jain, percentile

__all__ = [
    "RESULTS",
    "busy_slot_seconds",
    "crash_lines",
    "crashes",
    "environment",
    "git_commit",
    "load_over_time",
    "plot_cluster",
    "step_cdf",
    "summarize",
    "table",
    "write_json",
]

_ROOT = Path(__file__).resolve().parents[1]
# In a checkout, the committed results; installed (no pyproject.toml beside the package), the
# working directory's bench/results: site-packages is no place to write, nor, in the image,
# writable by its user.
RESULTS = (_ROOT if (_ROOT / "pyproject.toml").exists() else Path.cwd()) / "bench" / "results"


def _intervals(results: Iterable[Result], node: str) -> list[tuple[float, float]]:
    # A request holds its node from send to end only if the node took it: a 200. Failures end
    # at the proxy or before a slot (a refused connect, a 503), or never got a slot (a hang).
    return [(r.start, r.end) for r in results if r.node == node and r.status == 200]


def busy_slot_seconds(intervals: Sequence[tuple[float, float]], slots: int, window: float) -> float:
    """Slot-seconds in use over ``[0, window]``: at each instant the node runs
    min(in flight, slots) requests (the rest wait in its FIFO queue), integrated over time."""
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        start, end = max(0.0, start), min(window, end)
        if end > start:
            events += [(start, 1), (end, -1)]
    events.sort()
    busy = 0.0
    in_flight = 0
    last = 0.0
    for t, step in events:
        busy += min(in_flight, slots) * (t - last)
        in_flight += step
        last = t
    return busy


def load_over_time(
    intervals: Sequence[tuple[float, float]], window: float, step: float = 0.5
) -> list[float]:
    """Mean requests in flight at the node in each ``step`` bin of ``[0, window]``."""
    bins = max(1, math.ceil(window / step))
    out = [0.0] * bins
    for start, end in intervals:
        start, end = max(0.0, start), min(window, end)
        if end <= start:
            continue
        first, last = int(start // step), min(bins - 1, int(end // step))
        for b in range(first, last + 1):
            lo, hi = max(start, b * step), min(end, (b + 1) * step)
            if hi > lo:
                out[b] += (hi - lo) / step
    return out


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


FAILED_AS_S = 60.0  # a failed request, in latency_with_failures_ms: the generator's timeout


def summarize(
    results: Sequence[Result], slots: Mapping[str, int], duration: float
) -> dict[str, Any]:
    """Everything the report says about one run. Latency and TTFT percentiles are over the
    requests that succeeded; the error rate says how many did not, and why; and
    ``latency_with_failures_ms`` counts every request, a failed one as `FAILED_AS_S` (or its
    own time, if longer), so that a router that fails its slowest requests does not read
    faster than one that serves them late. ``duration`` is the trace's: utilisation and
    throughput are over ``[0, duration]``."""
    ok = [r for r in results if r.ok]
    latencies = [r.latency for r in ok]
    with_failures = [r.latency if r.ok else max(r.latency, FAILED_AS_S) for r in results]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    # A failure as FAILED_AS_S here too: the cache targets are judged on TTFT p90.
    ttfts_with_failures = ttfts + [FAILED_AS_S] * (len(results) - len(ok))
    span = max([duration, *(r.end for r in results)]) if results else duration
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    nodes: dict[str, Any] = {}
    for name, n_slots in slots.items():
        mine = _intervals(results, name)
        util = busy_slot_seconds(mine, n_slots, duration) / (n_slots * duration)
        nodes[name] = {
            "requests": sum(1 for r in results if r.node == name),
            "ok": sum(1 for r in ok if r.node == name),
            "share": round(sum(1 for r in ok if r.node == name) / max(1, len(ok)), 4),
            "utilisation": round(util, 4),
            "p99_ms": _ms(percentile([r.latency for r in ok if r.node == name], 99)),
        }
    lateness = [r.lateness for r in results]
    return {
        "requests": len(results),
        "ok": len(ok),
        "error_rate": round((len(results) - len(ok)) / max(1, len(results)), 4),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])),
        # Completions inside the trace's window: what the cluster got done while the load was
        # on. Over the whole span (the drain included) one straggler would drag a good run down.
        "throughput_rps": round(sum(1 for r in ok if r.end <= duration) / duration, 3)
        if duration > 0
        else 0.0,
        "goodput_over_span_rps": round(len(ok) / span, 3) if span > 0 else 0.0,
        "span_s": round(span, 3),
        "offered_rps": round(len(results) / duration, 3) if duration > 0 else 0.0,
        "latency_ms": {f"p{p}": _ms(percentile(latencies, p)) for p in (50, 90, 99)},
        "latency_with_failures_ms": {
            f"p{p}": _ms(percentile(with_failures, p)) for p in (50, 90, 99)
        },
        "ttft_ms": {f"p{p}": _ms(percentile(ttfts, p)) for p in (50, 90, 99)},
        "ttft_with_failures_ms": {
            f"p{p}": _ms(percentile(ttfts_with_failures, p)) for p in (50, 90, 99)
        },
        "jain_utilisation": _round(jain([n["utilisation"] for n in nodes.values()])),
        "send_lateness_ms": {
            "mean": _ms(sum(lateness) / len(lateness)) if lateness else None,
            "max": _ms(max(lateness)) if lateness else None,
        },
        "nodes": nodes,
    }


# A crash fails what it cuts at once: the streams on the node, and tries sent to it before the
# gateway sees it gone (a refused connect). Failures by waiting are a queue's doing, not its.
CRASH_WINDOW_S = 1.0
_WAITED = frozenset({"timeout", "unfinished", "http_504", "http_408"})


def crashes(
    results: Sequence[Result],
    applied: Sequence[Mapping[str, Any]],
    states: Mapping[str, Sequence[Sequence[Any]]] | None = None,
) -> list[dict[str, Any]]:
    """Each crash the run played (``applied``: the faults as played, on the results' clock):
    the requests lost at it and, given the gateway's node states over the run (``states``:
    per node its ``[t, state]`` changes), when the node was drained for its leak before it.

    A request is lost at node N's crash at T if it failed, was answered by N or by no node (a
    gateway's own error answer names none), did not fail by waiting (a timeout, a 504), and
    ended within ``CRASH_WINDOW_S`` of T: it was on N when N died, or sent to N just after."""
    out: list[dict[str, Any]] = []
    for fault in applied:
        if fault.get("kind") != "crash" or fault.get("outcome") != "ok":
            continue
        node, at = str(fault["node"]), float(fault["applied_at"])
        lost = [
            r
            for r in results
            if r.error
            and r.error not in _WAITED
            and r.node in (node, "?")
            and at <= r.end <= at + CRASH_WINDOW_S
        ]
        kinds: dict[str, int] = {}
        for r in lost:
            kinds[r.error] = kinds.get(r.error, 0) + 1
        row: dict[str, Any] = {
            "node": node,
            "at": round(at, 3),
            "lost": len(lost),
            "lost_errors": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        }
        if states is not None:
            seen = states.get(node, [])
            # The last time before the crash that it went into "leaking", if it did.
            drained = [float(t) for t, state in seen if state == "leaking" and float(t) <= at]
            row["drained_at"] = drained[-1] if drained else None
            row["drained_before_s"] = round(at - drained[-1], 3) if drained else None
            back = [float(t) for t, state in seen if state == "ready" and float(t) > at]
            row["ready_again_at"] = back[0] if back else None
        out.append(row)
    return out


def crash_lines(runs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per crash per run: requests lost, and the drain before it when watched."""
    lines: list[str] = []
    for name, run in runs.items():
        for c in run.get("crashes", ()):
            line = f"{name}: {c['node']} crashed at {c['at']:.1f}s, {c['lost']} requests lost"
            if "drained_at" in c:
                if c["drained_at"] is None:
                    line += "; not drained before it"
                else:
                    line += (
                        f"; drained (leaking) at {c['drained_at']:.1f}s, "
                        f"{c['drained_before_s']:.1f}s before"
                    )
                if c["ready_again_at"] is not None:
                    line += f"; ready again at {c['ready_again_at']:.1f}s"
            lines.append(line)
    return lines


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def table(runs: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per run: the headline numbers, then each node's share/utilisation."""
    head = (
        f"{'run':<30} {'p50':>7} {'p90':>7} {'p99':>7} {'ttft99':>7} {'rps':>6} "
        f"{'err%':>6} {'jain':>5}  per-node util% (share%)"
    )
    lines = [head, "-" * len(head)]
    for name, s in runs.items():
        lat, ttft = s["latency_ms"], s["ttft_ms"]
        per_node = " ".join(
            f"{n}={v['utilisation'] * 100:.0f}({v['share'] * 100:.0f})"
            for n, v in s["nodes"].items()
        )
        lines.append(
            f"{name:<30} {_fmt(lat['p50']):>7} {_fmt(lat['p90']):>7} {_fmt(lat['p99']):>7} "
            f"{_fmt(ttft['p99']):>7} {s['throughput_rps']:>6.1f} "
            f"{s['error_rate'] * 100:>6.2f} {_fmt(s['jain_utilisation'], '.3f'):>5}  {per_node}"
        )
    return "\n".join(lines)


def git_commit() -> str:
    """The commit measured: ``git rev-parse --short HEAD``, or "unknown" outside a checkout."""
    out = _git("rev-parse", "--short", "HEAD")
    return out or "unknown"


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args],
            cwd=_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    """Where the numbers come from. ``dirty``: tracked files differed from the commit, so the
    commit alone does not reproduce them. Results already written under ``bench/results/`` do
    not count: a suite run rewrites them as it goes, and they change no code that is measured."""
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return {
        "commit": git_commit(),
        "dirty": None if status is None else bool(status),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "cores": os.cpu_count(),
    }


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def step_cdf(ax: Any, values: Iterable[float], label: str) -> None:
    """One empirical CDF on matplotlib axes ``ax`` (nothing for no values)."""
    ordered = sorted(values)
    if ordered:
        ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, ys, where="post", label=label)


def plot_cluster(
    path: Path,
    title: str,
    runs: Mapping[str, Sequence[Result]],
    slots: Mapping[str, int],
    duration: float,
) -> None:
    """Latency CDF per run (top), then per run the load of each node over time: requests in
    flight per slot, so 1 is full and above 1 is a queue."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    names = list(runs)
    cols = 2 if len(names) > 1 else 1
    rows = math.ceil(len(names) / cols)
    fig = plt.figure(figsize=(7 * cols, 4 + 2.6 * rows))
    grid = fig.add_gridspec(1 + rows, cols, height_ratios=[1.6] + [1.0] * rows)
    cdf = fig.add_subplot(grid[0, :])
    for name in names:
        step_cdf(cdf, [r.latency for r in runs[name] if r.ok], name)
    cdf.set_xscale("log")
    cdf.set_xlabel("latency of successful requests (s, log scale)")
    cdf.set_ylabel("share of requests")
    cdf.set_title(title)
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize=8, loc="lower right")
    step = 0.5
    for k, name in enumerate(names):
        ax = fig.add_subplot(grid[1 + k // cols, k % cols])
        for node, n_slots in slots.items():
            load = load_over_time(_intervals(runs[name], node), duration, step)
            ax.plot([i * step for i in range(len(load))], [v / n_slots for v in load], label=node)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(f"{name}: in flight per slot", fontsize=9)
        ax.set_xlabel("s", fontsize=8)
        ax.tick_params(labelsize=7)
        if k == 0:
            ax.legend(fontsize=6, ncol=4, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
