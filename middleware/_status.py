"""``/_promptlb/status``: the node table as JSON, for people and scripts."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from ._balancer import Balancer
from ._scoring import score_parts
from ._strategy import Scoring
from ._view import NodeView

__all__ = ["status_json"]


def status_json(lb: Balancer) -> dict[str, Any]:
    now = time.monotonic()
    table = lb.table
    nodes = []
    for node in table.nodes.values():
        view = node.view
        snap = node.snapshot
        nodes.append(
            {
                "name": node.name,
                "url": node.config.url,
                "sidecar": node.config.sidecar,
                "state": table.state_of(node),
                "health": node.health_detail,
                "models": sorted(node.models),
                "tags": sorted(view.tags),
                "tier": view.tier,
                "weight": view.weight,
                "ramp": round(view.ramp, 3),
                "snapshot_age_s": round(now - node.snapshot_at, 3) if snap else None,
                "snapshot_trusted": view.snapshot is not None,
                "snapshot_errors": node.snapshot_errors,
                "load": {
                    "cpu": view.snapshot.cpu if view.snapshot else None,
                    "mem": view.snapshot.mem if view.snapshot else None,
                    "gpu": view.gpu_util,
                    "engine_queue": view.engine_queue,
                    "effective_queue": view.effective_queue,
                },
                "score": _score(lb, view),
                "in_flight": view.in_flight,
                "ewma_latency_ms": _ms(view.ewma_latency_s),
                "ewma_ttft_ms": _ms(view.ewma_ttft_s),
                "error_rate": round(view.error_rate, 4),
                "requests": node.requests,
                "failures": node.failures,
                "request_faults": node.request_faults,
                "ejected_for_s": round(node.ejected_until - now, 1)
                if node.ejected_until > now
                else 0,
                "times_ejected": node.times_ejected,
            }
        )
    return {"strategy": lb.config.strategy, "ready_models": table.ready_models(), "nodes": nodes}


def _score(lb: Balancer, view: NodeView) -> dict[str, Any]:
    """The p2c/resource cost and its parts, as the configured strategy weighs them (through
    any wrapper); the defaults for strategies that do not score."""
    scoring = lb.strategy.scoring or Scoring()
    parts = score_parts(
        view, scoring.weights, scoring.queue_scale, scoring.unknown_score, view.effective_queue
    )
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(parts).items()}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
