"""What a strategy sees: the request to route and a view of each candidate node.

Both are plain objects so that the live middleware, unit tests and a simulator with a virtual
clock can drive the same strategies. The node table (``_nodes``) owns and updates the views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from promptlb.shared import Snapshot

__all__ = ["NodeView", "Priority", "RouteRequest"]

Priority = Literal["critical", "standard", "sheddable"]


@dataclass(slots=True)
class RouteRequest:
    """One request, as far as routing cares. Treat it as immutable (`dataclasses.replace` for
    a changed copy): it is not frozen only because a frozen dataclass's constructor sets each
    field through ``object.__setattr__``, 0.5 us more on every request."""

    model: str
    input_tokens: int = 0
    max_tokens: int | None = None
    stream: bool = False
    prompt_class: str = ""
    session_key: str | None = None
    priority: Priority = "standard"
    # The prompt's coarse KV block hashes (`_prefix.prompt_blocks`), for cache-aware strategies.
    blocks: tuple[int, ...] = ()


@dataclass(slots=True, eq=False)
class NodeView:
    """One node: config, the latest trusted snapshot and what this middleware saw itself.

    ``snapshot`` is ``None`` when there is none or when it is older than ``stale_after``: the
    node's load is then *unknown*, which strategies must not read as idle.
    """

    name: str
    url: str
    weight: float = 1.0
    models: frozenset[str] = frozenset()
    tags: frozenset[str] = frozenset()
    tier: str = ""
    snapshot: Snapshot | None = None
    in_flight: int = 0  # requests this middleware has open on the node now
    in_flight_at_snapshot: int = 0  # ... when the current snapshot was taken in
    # The other gateway replicas' tries started less those ended since the current snapshot
    # came, as they share them (`[index_share]`); may be negative: ends of tries it counted.
    others_since_snapshot: int = 0
    ewma_latency_s: float | None = None
    ewma_ttft_s: float | None = None
    error_rate: float = 0.0  # EWMA of failures, 0..1
    ramp: float = 1.0  # slow start: 0 < ramp <= 1 while a node that joined or recovered warms

    @property
    def engine_queue(self) -> int | None:
        """Requests the engine runs or queues, per the snapshot; ``None`` when unknown."""
        snap = self.snapshot
        if snap is None or snap.engine is None:
            return None
        return snap.engine.running + snap.engine.waiting

    @property
    def effective_queue(self) -> int:
        """The node's queue now: others' requests as the engine last reported them (its count
        less ours at that moment) and as the other replicas told since, plus ours now. Without
        a snapshot: ours alone."""
        # Written flat (no engine_queue, no max()): least_conn reads it for every candidate,
        # and the nested property and max() cost twice the rest of its loop.
        queue = self.in_flight
        snap = self.snapshot
        if snap is not None and (engine := snap.engine) is not None:
            others = engine.running + engine.waiting - self.in_flight_at_snapshot
            others += self.others_since_snapshot
            if others > 0:
                queue += others
        return queue

    @property
    def gpu_util(self) -> float | None:
        snap = self.snapshot
        if snap is None or not snap.gpus:
            return None
        known = [g.util for g in snap.gpus if g.util is not None]  # (MIG cards have none)
        return sum(known) / len(known) if known else None
