"""The simulator's shared state: the event heap on virtual time, the nodes, the replicas and the
tallies that become the `SimResult`. The event handlers are mixins over it (`_simdetect`,
`_simperfect`, `_simtries`, `_simfaults`); `_simcore` runs the loop."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from promptlb.middleware._config import INDEX_SHARE_EVERY, OutlierConfig
from promptlb.middleware._prefix import Reading
from promptlb.middleware._rules import RetryBudget, ejection_cap
from promptlb.shared import ConfigError

from ._scenario import Arrival, NodeSpec
from ._simnode import Group, Node
from ._simparams import AFFINITY, ORACLE, PERFECT, SHARED, SIM_STRATEGIES, ServiceFn, SimParams
from ._simprompt import Prompted, Read, read
from ._simreplica import Replica, View, build_strategy

__all__ = [
    "CONNECT_FAIL",
    "DETECT",
    "FAULT",
    "FINISH",
    "HEADERS",
    "KV_SAMPLE",
    "MARK",
    "OUTLIER",
    "REFRESH",
    "SHARE",
    "TIMEOUT",
    "UNEJECT",
    "SimState",
]

# Event kinds. Ties in time are broken by a sequence number, so the order is deterministic.
FINISH, CONNECT_FAIL, TIMEOUT, REFRESH, FAULT, DETECT, UNEJECT, MARK, SHARE, KV_SAMPLE = range(10)
HEADERS = 10  # a retry's headers came: it leaves the retry budget
# The middleware's ejection defaults: SimParams sets only how many failures eject.
OUTLIER = OutlierConfig()


class SimState:
    """A run's state from its start: the replicas built and the refreshes, faults and the
    utilisation mark on the heap; the perfect dispatcher's groups are built when it runs."""

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        arrivals: Sequence[Arrival],
        strategy: str,
        duration: float,
        params: SimParams,
        options: Mapping[str, Any],
        service: ServiceFn | None,
        prepared: Sequence[Prompted | None] | None = None,
        reads: Sequence[Read] | None = None,
    ) -> None:
        if strategy not in SIM_STRATEGIES:
            raise ConfigError("strategy", strategy, "one of " + ", ".join(SIM_STRATEGIES))
        untimed = math.isinf(params.per_try_timeout) and math.isinf(params.client_timeout)
        if untimed and any(f.kind == "hang" for spec in nodes for f in spec.faults):
            # A try on the hung node would never end, nor the run (its periodic events never
            # run out): the timeouts are what end it, live.
            raise ConfigError("client_timeout", params.client_timeout, "finite with a hang fault")
        self.params = params
        self.name = strategy
        # The oracle is a perfect dispatcher too (exact, instant state, no replicas), that
        # also reads every node's KV cache.
        self.oracle = strategy == ORACLE
        self.perfect = strategy == PERFECT or self.oracle
        self.keyed = strategy.endswith(AFFINITY)  # routes carry [affinity]'s key
        shared = strategy.endswith(SHARED)
        self.share_every = params.share_every or (INDEX_SHARE_EVERY if shared else 0.0)
        built = strategy.removesuffix(SHARED)
        # Per arrival, its prompt read by the engine (`_simprompt`); with any, every
        # node keeps the emulator's KV cache.
        self.prepared = prepared
        kv = prepared is not None and any(p is not None for p in prepared)
        # Per arrival, the body sent read by the gateway: what its strategy routes on.
        if reads is None and not self.perfect:
            reads = read(arrivals, params.model)
        self.reads: Sequence[Read] = reads or ()
        self.arrivals = arrivals
        self.duration = duration
        self.service = service
        self.service_rng = random.Random(params.seed * 7_919 + 17)
        # The oracle's draw among equally good nodes, as the live oracle draws.
        self.oracle_rng = random.Random(params.seed * 104_729 + 3)
        self.nodes = [Node(i, spec, kv) for i, spec in enumerate(nodes)]
        # (virtual time, sequence, event kind, object, try number)
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.seq = itertools.count()
        self.pending = 0
        self.last_t = 0.0
        self.retries = 0
        self.ejections = 0
        self.errors: dict[str, int] = {}
        self.latencies: array[float] = array("d")
        self.in_window = 0  # successes that ended within the trace's window
        self.waits: array[float] = array("d")
        self.ttfts: array[float] = array("d")
        self._replanned = False  # a start found other cached blocks than its forecast took
        self.replicas: list[Replica] = []
        # (replica, when) -> (node, up, its first check): the checks that end a streak then
        self.detect_at: dict[tuple[int, float], list[tuple[int, bool, float]]] = {}
        self.groups: dict[tuple[float, float, float, float], Group] = {}
        self.group_list: list[Group] = []
        # The simulated nodes all serve the one model: the pool is every node.
        self.eject_cap = ejection_cap(len(self.nodes), OUTLIER.max_ejection_percent)
        if not self.perfect:
            count = params.replicas
            for r in range(count):
                views: list[View] = []
                for node in self.nodes:
                    view = View(
                        name=node.name,
                        url=f"sim://{node.name}",
                        tier=node.spec.tier,
                        tags=frozenset(node.spec.tags),
                    )
                    view.idx = node.idx
                    view.snapshot = node.snapshot(0.0)
                    views.append(view)
                # Seeded per replica and alike for every strategy: runs differ in the policy.
                rng = random.Random(params.seed * 1_000_003 + r)
                budget = RetryBudget(params.budget_percent, params.budget_min)
                self.replicas.append(Replica(build_strategy(built, options), rng, views, budget))
                if params.staleness > 0:
                    phase = params.staleness * r / count
                    self._push(phase if phase > 0 else params.staleness, REFRESH, r)
        # The replicas' shared store, as the Redis stream holds it: one entry per exchange
        # (replica, its prefix records, its readings, its tries ended per node) in the order
        # written, and how far each replica has read.
        self.shared: list[
            tuple[int, list[tuple[str, Sequence[int]]], list[Reading], list[tuple[str, int]]]
        ] = []
        self.read_upto = [0] * len(self.replicas)
        every = self.share_every
        if every > 0:
            for r, replica in enumerate(self.replicas):
                index = replica.strategy.prefix_index
                if index is not None:
                    index.share()
                    self._push(every * (r + 1) / len(self.replicas), SHARE, r)
        for node in self.nodes:
            for fault in node.spec.faults:
                self._push(fault.at, FAULT, (node, fault))
        self._push(duration, MARK, None)
        self.kv_use: dict[str, list[float]] = {}
        if kv:  # how full each node's KV cache is, once a second, for the report's plot
            self.kv_use = {node.name: [] for node in self.nodes}
            self._push(0.0, KV_SAMPLE, None)

    def _push(self, t: float, kind: int, obj: Any, try_no: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, obj, try_no))
