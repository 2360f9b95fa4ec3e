"""``/_promptlb/status``: the node table as JSON, for people, scripts and the dashboard.

Everything here is computed when the page is asked for (about once a second per open
dashboard), never on the request path: percentiles from each node's bounded window of recent
answers (`Node.recent_latency_s`), rates from the differences between this page's own recent
readings of the nodes' counters, totals from the Prometheus counters.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from prometheus_client import Counter

from ._balancer import Balancer
from ._nodes import Node
from ._scoring import score_parts
from ._strategy import Scoring
from ._view import NodeView

__all__ = ["StatusPage", "jain_index", "percentile", "status_json"]

WINDOW_S = 10.0  # rates are over about the last this many seconds
_MIN_SPAN_S = 0.5  # readings closer than this give no rate yet
# "leaking": the model server's memory, at its sidecar's measured slope, grows by this much
# within the hour (and by this share of itself): the dashboard's early sign of an OOM to come.
LEAK_BYTES_PER_HOUR = 256 * 2**20
LEAK_SHARE_PER_HOUR = 0.1

_Reading = tuple[float, dict[str, tuple[int, int]]]  # (monotonic time, node -> (tries, failures))


class StatusPage:
    """Renders the status document; keeps the last ``WINDOW_S`` of its own readings (shared by
    every viewer: they are readings of the same counters), and the one before them, to turn
    counts into rates: over about the window, or since the last look when that was longer
    ago."""

    def __init__(self) -> None:
        self._readings: deque[_Reading] = deque()

    def render(self, lb: Balancer) -> dict[str, Any]:
        now = time.monotonic()
        reading: _Reading = (
            now,
            {name: (n.requests, n.failures) for name, n in lb.table.nodes.items()},
        )
        readings = self._readings
        # The newest reading older than the window stays as the base: a script polling less
        # often than WINDOW_S found none left, and got no rate and whole-life ratios.
        while len(readings) > 1 and now - readings[1][0] > WINDOW_S:
            readings.popleft()
        base = readings[0] if readings and now - readings[0][0] >= _MIN_SPAN_S else None
        if not readings or now - readings[-1][0] >= _MIN_SPAN_S:
            readings.append(reading)
        doc = status_json(lb, now)
        _add_rates(doc, reading, base)
        return doc


def status_json(lb: Balancer, now: float | None = None) -> dict[str, Any]:
    now = time.monotonic() if now is None else now
    table = lb.table
    nodes: list[dict[str, Any]] = []
    tokens_per_s: float | None = None
    for node in table.nodes.values():
        view = node.view
        snap = view.snapshot  # trusted and fresh, or None
        engine = snap.engine if snap else None
        if engine is not None and engine.tps is not None:
            tokens_per_s = (tokens_per_s or 0.0) + engine.tps
        nodes.append(
            {
                "name": node.name,
                "url": node.config.url,
                "sidecar": node.config.sidecar,
                "state": table.state_of(node),
                "leaking": _leaking(node),
                "health": node.health_detail,
                "models": sorted(node.models),
                "tags": sorted(view.tags),
                "tier": view.tier,
                "weight": view.weight,
                "ramp": round(view.ramp, 3),
                "snapshot_age_s": round(now - node.snapshot_at, 3) if node.snapshot else None,
                "snapshot_trusted": snap is not None,
                "snapshot_errors": node.snapshot_errors,
                "load": {
                    "cpu": snap.cpu if snap else None,
                    "mem": snap.mem if snap else None,
                    "gpu": view.gpu_util,
                    "engine_queue": view.engine_queue,
                    "effective_queue": view.effective_queue,
                },
                "gpus": [
                    {
                        "i": g.i,
                        "util": g.util,
                        "mem_used_mib": g.mem_used,
                        "mem_total_mib": g.mem_total,
                        "temp_c": g.temp_c,
                        "power_w": g.power_w,
                    }
                    for g in (snap.gpus if snap else ())
                ],
                "engine": None
                if engine is None
                else {
                    "running": engine.running,
                    "waiting": engine.waiting,
                    "kv_cache": engine.kv_cache,
                    "tps": engine.tps,
                },
                "rss_bytes": snap.rss if snap else None,
                "rss_slope_bytes_per_s": snap.rss_slope if snap else None,
                "score": _score(lb, view),
                "in_flight": view.in_flight,
                "ewma_latency_ms": _ms(view.ewma_latency_s),
                "ewma_ttft_ms": _ms(view.ewma_ttft_s),
                "latency_ms": _percentiles(node.recent_latency_s),
                "ttft_ms": _percentiles(node.recent_ttft_s),
                "error_rate": round(view.error_rate, 4),
                "requests": node.requests,
                "failures": node.failures,
                "request_faults": node.request_faults,
                "refusals": node.refusals,
                "ejected_for_s": round(node.ejected_until - now, 1)
                if node.ejected_until > now
                else 0,
                "times_ejected": node.times_ejected,
            }
        )
    metrics = lb.metrics
    totals = {
        "nodes": len(nodes),
        "nodes_ready": sum(1 for n in nodes if n["state"] == "ready"),
        "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 1),
        "requests": sum(n["requests"] for n in nodes),
        "failures": sum(n["failures"] for n in nodes),
        "fallbacks": _count(metrics.fallbacks),
        "cache_answers": _count(metrics.cache, lambda labels: labels["result"] != "miss"),
        "shed": _count(metrics.shed),
        "no_node_available": _count(metrics.unavailable),
    }
    return {
        "strategy": lb.config.strategy,
        "ready_models": table.ready_models(),
        "totals": totals,
        "nodes": nodes,
    }


def _add_rates(doc: dict[str, Any], now: _Reading, base: _Reading | None) -> None:
    """Per node ``qps`` and ``share``, and the cluster's ``qps``, ``success_rate`` and
    ``balance_index`` over the readings' span; over everything counted while there is no
    span yet (the first look), with ``window_s`` null."""
    span = now[0] - base[0] if base is not None else None
    before = base[1] if base is not None else {}
    tries: dict[str, float] = {}
    failed = 0
    for name, (requests, failures) in now[1].items():
        old = before.get(name, (0, 0))
        tries[name] = max(0, requests - old[0])
        failed += max(0, failures - old[1])
    total = sum(tries.values())
    ready = []
    for node in doc["nodes"]:
        count = tries.get(node["name"], 0.0)
        node["qps"] = round(count / span, 2) if span else None
        node["share"] = round(count / total, 4) if total else None
        if node["state"] == "ready":
            ready.append(count)
    totals = doc["totals"]
    totals["window_s"] = round(span, 2) if span else None
    totals["qps"] = round(total / span, 2) if span else None
    totals["success_rate"] = round(1 - failed / total, 4) if total else None
    totals["balance_index"] = jain_index(ready)


def jain_index(values: Iterable[float]) -> float | None:
    """Jain's fairness index, (sum x)^2 / (n * sum x^2): 1 when every node gets the same
    traffic, 1/n when one gets it all; None when there is no traffic."""
    xs = list(values)
    squares = sum(x * x for x in xs)
    if not xs or squares == 0:
        return None
    return round(sum(xs) ** 2 / (len(xs) * squares), 4)


def percentile(ordered: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list (not empty)."""
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def _percentiles(samples: Iterable[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    if not ordered:
        return {"p50": None, "p90": None, "p99": None, "samples": 0}
    out: dict[str, Any] = {
        name: round(percentile(ordered, p) * 1000, 1)
        for name, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
    }
    out["samples"] = len(ordered)
    return out


def _leaking(node: Node) -> bool:
    snap = node.view.snapshot
    if snap is None or snap.rss is None or snap.rss_slope is None or snap.rss_slope <= 0:
        return False
    growth = snap.rss_slope * 3600
    return growth >= LEAK_BYTES_PER_HOUR and growth >= LEAK_SHARE_PER_HOUR * snap.rss


def _count(counter: Counter, where: Any = None) -> int:
    """A counter's total over its label sets (those ``where`` accepts)."""
    total = 0.0
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and (where is None or where(sample.labels)):
                total += sample.value
    return int(total)


def _score(lb: Balancer, view: NodeView) -> dict[str, Any]:
    """The p2c/resource cost and its parts, as the configured strategy weighs them (through
    any wrapper); the defaults for strategies that do not score."""
    scoring = lb.strategy.scoring or Scoring()
    queue = None if scoring.engine_queue_only else view.effective_queue
    parts = score_parts(view, scoring.weights, scoring.queue_scale, scoring.unknown_score, queue)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(parts).items()}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
