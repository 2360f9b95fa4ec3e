"""The simulator's shared state: the event heap on virtual time, the nodes, the replicas and the
tallies that become the `SimResult`. The event handlers are mixins over it (`_simdetect`,
`_simperfect`, `_simtries`, `_simfaults`); `_simcore` runs the loop."""

from __future__ import annotations

import heapq
import itertools
import random
from array import array
from collections.abc import Sequence
from typing import Any

from promptlb.middleware._config import OutlierConfig
from promptlb.middleware._rules import ejection_cap

from ._scenario import Arrival, NodeSpec
from ._simnode import Group, Node
from ._simparams import PERFECT, ServiceFn, SimParams
from ._simreplica import Replica

__all__ = [
    "CONNECT_FAIL",
    "DETECT",
    "FAULT",
    "FINISH",
    "MARK",
    "OUTLIER",
    "REFRESH",
    "TIMEOUT",
    "UNEJECT",
    "SimState",
]

# Event kinds. Ties in time are broken by a sequence number, so the order is deterministic.
FINISH, CONNECT_FAIL, TIMEOUT, REFRESH, FAULT, DETECT, UNEJECT, MARK = range(8)
# The middleware's ejection defaults: SimParams sets only how many failures eject.
OUTLIER = OutlierConfig()


class SimState:
    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        arrivals: Sequence[Arrival],
        strategy: str,
        duration: float,
        params: SimParams,
        service: ServiceFn | None,
    ) -> None:
        self.params = params
        self.name = strategy
        self.perfect = strategy == PERFECT
        self.arrivals = arrivals
        self.duration = duration
        self.service = service
        self.service_rng = random.Random(params.seed * 7_919 + 17)
        self.nodes = [Node(i, spec) for i, spec in enumerate(nodes)]
        # (virtual time, sequence, event kind, object, try number)
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.seq = itertools.count()
        self.pending = 0
        self.last_t = 0.0
        self.retries = 0
        self.ejections = 0
        self.errors: dict[str, int] = {}
        self.latencies: array[float] = array("d")
        self.waits: array[float] = array("d")
        self.replicas: list[Replica] = []
        self.detect_at: dict[tuple[int, float], list[tuple[int, bool]]] = {}
        self.groups: dict[tuple[float, float, float, float], Group] = {}
        self.group_list: list[Group] = []
        # The simulated nodes all serve the one model: the pool is every node.
        self.eject_cap = ejection_cap(len(self.nodes), OUTLIER.max_ejection_percent)

    def _push(self, t: float, kind: int, obj: Any, try_no: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, obj, try_no))
