"""The simulator's engine: emulated node queues on a virtual clock, routed by the real strategies.

One run replays an arrival trace against a list of `NodeSpec` with one routing policy and returns
the raw outcome (`SimResult`); `_sim` turns runs into the report. Nothing here sleeps or awaits:
events sit in a heap keyed by virtual time, and the trace (already sorted) is merged with it.

The node is the emulator's (``emulator/_capacity.py``, ``_app.py``): ``slots`` requests are
served at once, the rest wait in a FIFO queue, and a request takes
``(ttft_ms / 1000 + prompt_tokens / prefill_tokens_per_s + max_tokens / tokens_per_s) * factor``
seconds, its first token (and, streaming, its response headers) coming after the first two terms.
``factor`` is the ``slow`` fault's when the request reached the node: the emulator reads its
``slow_factor`` once per request, on admission, so a change applies to requests that come after.
``crash`` drops everything on the node and refuses connections until ``recover``; ``hang``
holds new requests at admission, out of the engine's counts (work already admitted goes on),
until ``recover`` lifts it and they go on in order, as the emulator's runtime hang does;
``recover`` also sets the factor back to 1. ``leak`` costs memory, not time: not simulated.

The middleware is each replica's ``Balancer.open`` and ``NodeTable``, on virtual time:

* ``replicas`` replicas, each with its own strategy object, random generator and `NodeView` per
  node; arrivals go to the replicas in turn, as a round-robin L4 balancer in front would send them.
* A replica's ``in_flight`` is exact (its own tries); the engine's running/waiting and tokens/s
  (of the requests past their first token, each at its rate) reach it as a `Snapshot`
  refreshed every ``staleness`` seconds, the replicas' phases staggered over the
  period. ``in_flight_at_snapshot`` is set at each refresh, as ``NodeTable.record_snapshot`` does.
* Tries: up to ``attempts``, never the same node twice, retried on a refused connection, a reset
  before the headers and the per-try timeout to the headers, within the retry budget (retries in
  flight below ``max(budget_min, budget_percent% of active requests)``). A stream that breaks
  after its first byte is not retried.
* Health checks, ``health_interval`` apart and staggered per replica, take a crashed node out of
  the candidates after ``unhealthy_threshold`` failures and back after ``healthy_threshold``
  passes; ``outlier_failures`` failed tries in a row eject a node for ``30 s x times ejected``
  (at most 300 s, at most half the nodes). A node back from either ramps up over ``slow_start``.
* The client (the benchmark's load generator) gives up ``client_timeout`` after the arrival.

``perfect`` is not a strategy object but the bound: one dispatcher with exact, instant knowledge
of every queue (join the shortest expected delay). ``random`` is a simulator-only baseline.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import random
import time
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from promptlb.middleware._refusals import NoNodeAvailable
from promptlb.middleware._strategies import STRATEGIES, make_strategy
from promptlb.middleware._strategy import Static as _Static
from promptlb.middleware._strategy import Strategy
from promptlb.middleware._view import NodeView, RouteRequest
from promptlb.shared import ConfigError, EngineSample, Snapshot

from ._scenario import Arrival, Fault, NodeSpec

__all__ = [
    "PERFECT",
    "RANDOM",
    "SIM_STRATEGIES",
    "RandomChoice",
    "ServiceFn",
    "SimParams",
    "SimResult",
    "simulate",
]

PERFECT = "perfect"
RANDOM = "random"
# Every name `simulate` accepts: the middleware's strategies and the simulator's two extras.
SIM_STRATEGIES = (*STRATEGIES, RANDOM, PERFECT)

# A replacement for the deterministic service time (seconds at slow factor 1), for tests that
# need a textbook distribution: called once per try, when the try reaches its node.
ServiceFn = Callable[[NodeSpec, Arrival, random.Random], float]

_UP, _CRASHED, _HUNG = 0, 1, 2  # a node's state
_CONNECTING, _QUEUED, _RUNNING, _STUCK = 0, 1, 2, 3  # a try's phase; _STUCK: on a hung node
# Event kinds. Ties in time are broken by a sequence number, so the order is deterministic.
_FINISH, _CONNECT_FAIL, _TIMEOUT, _REFRESH, _FAULT, _DETECT, _UNEJECT, _MARK = range(8)
_MIN_RAMP = 0.1  # as middleware/_nodes.py: a warming node starts at a tenth of its share
_EJECTION_BASE = 30.0  # OutlierConfig's defaults
_EJECTION_MAX = 300.0
_EJECTION_PERCENT = 50.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SimParams:
    """The middleware's and the client's side of a run. Defaults are the middleware's config
    defaults, but for the health interval: 1 s, as the benchmark's gateways run (default 5 s)."""

    replicas: int = 8
    staleness: float = 1.0  # seconds between a replica's snapshot refreshes; 0: always fresh
    attempts: int = 3  # tries in all, the first included
    per_try_timeout: float = 30.0  # to the response headers (the first token, streaming)
    client_timeout: float = 60.0  # the load generator's per-request total timeout
    budget_percent: float = 20.0
    budget_min: int = 3
    health_interval: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 2
    outlier_failures: int = 5  # 0 disables ejection
    connect_fail_s: float = 0.005  # a refused connection to a dead process: a few ms
    slow_start: float = 30.0
    seed: int = 1
    model: str = "bench"

    def __post_init__(self) -> None:
        for key in ("replicas", "attempts", "unhealthy_threshold", "healthy_threshold"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, value, "an integer >= 1")
        for key in ("budget_min", "outlier_failures"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(key, value, "an integer >= 0")
        for key in ("staleness", "slow_start", "connect_fail_s", "budget_percent"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(key, value, "a number >= 0")
        for key in ("per_try_timeout", "client_timeout", "health_interval"):
            value = getattr(self, key)
            if not value > 0:  # inf is allowed: no timeout
                raise ConfigError(key, value, "a duration > 0")


@dataclass(slots=True, kw_only=True)
class SimResult:
    """What one run produced. Latencies and waits are of the requests that succeeded."""

    strategy: str
    requests: int
    latencies: array[float]  # seconds from arrival to the last token, retries included
    waits: array[float]  # seconds queued on the node that served the request
    errors: dict[str, int]  # by the last try's cause: crash, connect, timeout, reset, no_node
    retries: int  # tries after the first
    ejections: int
    node_names: list[str]
    dispatched: list[int]  # tries that reached each node (refused connections excluded)
    served: list[int]  # successful requests per node
    busy: list[float]  # slot-seconds of work per node within [0, duration]
    slots: list[int]
    max_depth: list[int]  # most requests on the node at once (running + queued)
    duration: float
    makespan: float  # virtual time of the last completion or failure
    wall_s: float
    events: int

    @property
    def ok(self) -> int:
        return len(self.latencies)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())


class RandomChoice(_Static):
    """A uniformly random candidate: the textbook baseline power-of-two choices is measured by.
    Not one of the middleware's strategies; only the simulator offers it."""

    name = RANDOM

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        if not candidates:
            raise NoNodeAvailable(request.model)
        return candidates[rng.randrange(len(candidates))]


class _View(NodeView):
    """A `NodeView` that knows its node's index, so a pick maps back to a node in O(1)."""

    __slots__ = ("idx",)
    idx: int


class _Req:
    """One request of the trace, across its tries. Per-try fields are reset by `_Sim._send`."""

    __slots__ = (
        "armed",
        "arrival",
        "base",
        "born",
        "cut",
        "deadline",
        "done",
        "factor",
        "finish",
        "head",
        "last",
        "node",
        "phase",
        "queued",
        "replica",
        "retry_try",
        "route",
        "sent",
        "start",
        "tried",
        "try_no",
        "view",
    )

    def __init__(self, arrival: Arrival, replica: int, route: RouteRequest | None) -> None:
        self.arrival = arrival
        self.born = arrival.at
        self.replica = replica
        self.route = route
        self.tried: list[int] = []
        self.try_no = 0
        self.done = False
        self.last = "no_node"  # why the latest try failed
        self.view: _View | None = None
        self.node: _Node | None = None
        self.phase = _CONNECTING
        self.retry_try = False  # this try is a retry: it holds a place in the retry budget
        self.armed = False  # a per-try timeout event is pending for this try
        self.cut = False  # the client gives up before this try would finish
        self.sent = 0.0
        self.deadline = 0.0
        self.start = 0.0
        self.base = 0.0  # service seconds at slow factor 1
        self.factor = 1.0  # the node's slow factor when this try reached it
        self.head = 0.0  # of which before the first token
        self.finish = 0.0
        self.queued = 0  # the view's effective queue when this try was picked


class _Group:
    """Nodes with the same service-time parameters, for the perfect dispatcher: within a group
    the node whose earliest free slot comes first is the best, so one heap per group suffices."""

    __slots__ = ("a", "b", "c", "heap", "members")

    def __init__(self, spec: NodeSpec, factor: float) -> None:
        self.a = spec.ttft_ms / 1000 * factor
        self.b = factor / spec.tokens_per_s
        self.c = factor / spec.prefill_tokens_per_s if spec.prefill_tokens_per_s else 0.0
        # (earliest free slot, node version, node index): stale entries are skipped on read.
        self.heap: list[tuple[float, int, int]] = []
        self.members: set[int] = set()


class _Node:
    __slots__ = (
        "active",
        "busy",
        "busy_mark",
        "cur",
        "dispatched",
        "factor",
        "free",
        "group",
        "hung",
        "idx",
        "inv_prefill",
        "inv_tps",
        "max_depth",
        "name",
        "queue",
        "running",
        "served",
        "slots",
        "snaps",
        "spec",
        "stale",
        "state",
        "t_last",
        "ttft",
        "version",
    )

    def __init__(self, idx: int, spec: NodeSpec) -> None:
        self.idx = idx
        self.spec = spec
        self.name = spec.name
        self.slots = spec.slots
        self.ttft = spec.ttft_ms / 1000
        self.inv_tps = 1.0 / spec.tokens_per_s
        self.inv_prefill = 1.0 / spec.prefill_tokens_per_s if spec.prefill_tokens_per_s else 0.0
        self.factor = 1.0
        self.state = _UP
        self.running = 0
        self.queue: deque[_Req] = deque()
        # Queue entries whose try has ended (timed out, failed): left in place and skipped at
        # the head, which keeps giving up O(1). The engine's waiting count leaves them out.
        self.stale = 0
        # Running tries, in the order they started: a dict, not a set, so that iterating it (a
        # crash, a slow fault) is the same from run to run, and so are the results.
        self.active: dict[_Req, None] = {}
        self.hung: list[_Req] = []
        self.busy = 0.0
        self.busy_mark = -1.0
        self.t_last = 0.0
        self.served = 0
        self.dispatched = 0
        self.max_depth = 0
        # Snapshots interned by (running, waiting, tokens/s): strategies read only the engine's
        # numbers, and the same object for the same numbers keeps `Resource`'s cache warm.
        self.snaps: dict[tuple[int, int, float], Snapshot] = {}
        # The snapshot of the counts now, or None once they changed: replicas refresh every
        # node every period, and most nodes' counts have not moved since the last replica did.
        self.cur: Snapshot | None = None
        self.free: list[float] = [0.0] * spec.slots  # perfect only: when each slot frees up
        self.group: _Group | None = None
        self.version = 0

    def snapshot(self, now: float) -> Snapshot:
        waiting = len(self.queue) - self.stale
        # Tokens/s as the engine's counter shows it: only requests past their first token
        # decode, each at the rate its slow factor set.
        tps = 0.0
        for req in self.active:
            if req.start + req.head * req.factor <= now:
                tps += 1.0 / req.factor
        tps = round(tps * self.spec.tokens_per_s, 1)
        key = (self.running, waiting, tps)
        snap = self.snaps.get(key)
        if snap is None:
            snap = Snapshot(
                node=self.name,
                boot="sim",
                seq=0,
                ts=0.0,
                ready=True,
                warm=True,
                engine=EngineSample(running=self.running, waiting=waiting, tps=tps),
            )
            self.snaps[key] = snap
        self.cur = snap
        return snap

    def integrate(self, now: float) -> None:
        self.busy += self.running * (now - self.t_last)
        self.t_last = now


class _Replica:
    """One middleware replica: its strategy, its node views and its node table's state."""

    __slots__ = (
        "active",
        "alive",
        "cands",
        "consecutive",
        "ejected",
        "ejected_until",
        "n_ejected",
        "ramping",
        "retrying",
        "rng",
        "strategy",
        "times_ejected",
        "views",
    )

    def __init__(self, strategy: Strategy, rng: random.Random, views: list[_View]) -> None:
        n = len(views)
        self.strategy = strategy
        self.rng = rng
        self.views = views
        self.cands: list[_View] = list(views)
        self.alive = [True] * n  # by health checks
        self.ejected = [False] * n  # by outlier detection
        self.ejected_until = [0.0] * n
        self.n_ejected = 0
        self.times_ejected = [0] * n
        self.consecutive = [0] * n
        self.ramping: dict[int, float] = {}  # node index -> ready since
        self.active = 0  # requests open on this replica (the retry budget's base)
        self.retrying = 0  # retry tries waiting for their headers

    def rebuild(self) -> None:
        alive, ejected = self.alive, self.ejected
        self.cands = [v for v in self.views if alive[v.idx] and not ejected[v.idx]]


def _make(name: str, options: Mapping[str, Any]) -> Strategy:
    if name == RANDOM:
        return RandomChoice()
    return make_strategy(name, **options)


class _Sim:
    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        arrivals: Sequence[Arrival],
        strategy: str,
        duration: float,
        params: SimParams,
        options: Mapping[str, Any],
        service: ServiceFn | None,
    ) -> None:
        if strategy not in SIM_STRATEGIES:
            raise ConfigError("strategy", strategy, "one of " + ", ".join(SIM_STRATEGIES))
        self.params = params
        self.name = strategy
        self.perfect = strategy == PERFECT
        self.arrivals = arrivals
        self.duration = duration
        self.service = service
        self.service_rng = random.Random(params.seed * 7_919 + 17)
        self.nodes = [_Node(i, spec) for i, spec in enumerate(nodes)]
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.seq = itertools.count()
        self.pending = 0
        self.last_t = 0.0
        self.retries = 0
        self.ejections = 0
        self.errors: dict[str, int] = {}
        self.latencies: array[float] = array("d")
        self.waits: array[float] = array("d")
        self.replicas: list[_Replica] = []
        self.detect_at: dict[tuple[int, float], list[tuple[int, bool]]] = {}
        self.groups: dict[tuple[float, float, float, float], _Group] = {}
        self.group_list: list[_Group] = []
        # At most half the nodes ejected at once, but always one (Envoy's rule, as _nodes.py).
        self.eject_cap = max(1, math.floor(len(self.nodes) * _EJECTION_PERCENT / 100))
        if self.perfect:
            for node in self.nodes:
                self._join_group(node)
        else:
            count = params.replicas
            for r in range(count):
                views: list[_View] = []
                for node in self.nodes:
                    view = _View(
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
                self.replicas.append(_Replica(_make(strategy, options), rng, views))
                if params.staleness > 0:
                    phase = params.staleness * r / count
                    self._push(phase if phase > 0 else params.staleness, _REFRESH, r)
        for node in self.nodes:
            for fault in node.spec.faults:
                self._push(fault.at, _FAULT, (node, fault))
        self._push(duration, _MARK, None)

    # -- plumbing ----------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj: Any, try_no: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, obj, try_no))

    def _end_try(self, req: _Req) -> None:
        """The try is over, whatever its outcome: the replica's counts let go of it."""
        view = req.view
        if view is not None:
            view.in_flight -= 1
            req.view = None
        if req.retry_try:
            req.retry_try = False
            self.replicas[req.replica].retrying -= 1

    def _fail(self, req: _Req, kind: str, when: float) -> None:
        self._end_try(req)
        req.done = True
        if not self.perfect:
            self.replicas[req.replica].active -= 1
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.pending -= 1
        if when > self.last_t:
            self.last_t = when

    def _try_failed(self, req: _Req, kind: str, now: float) -> None:
        """A try failed before its headers: the proxy tries another node if it may."""
        node = req.node
        self._end_try(req)
        if node is not None and not self.perfect:
            self._record(req.replica, node.idx, ok=False, now=now)
        req.last = kind
        if now >= req.born + self.params.client_timeout:
            self._fail(req, "timeout", now)  # the client has already given up
        elif len(req.tried) >= self.params.attempts:
            self._fail(req, kind, now)
        else:
            self._route(req, now)

    # -- routing -----------------------------------------------------------------------------
    def _route(self, req: _Req, now: float) -> None:
        tried = req.tried
        if self.perfect:
            best = self._perfect_pick(req.arrival, now, tried)
            if best is None:
                self._fail(req, req.last, now)
                return
            if tried:
                self.retries += 1
            tried.append(best.idx)
            self._send(req, best, now, None)
            return
        replica = self.replicas[req.replica]
        if self.params.staleness == 0:
            self._refresh(replica, now)
        cands: list[_View] = replica.cands
        if tried:
            # Rare (retries only): never the same node twice, as Balancer.open.
            cands = cands.copy()  # copy and remove run in C: a 1,000-node list costs microseconds
            views = replica.views
            for idx in tried:
                with contextlib.suppress(ValueError):
                    cands.remove(views[idx])
            budget = max(self.params.budget_min, self.params.budget_percent / 100 * replica.active)
            if not cands or replica.retrying >= budget:
                self._fail(req, req.last, now)
                return
        route = req.route
        assert route is not None
        try:
            view = replica.strategy.pick(route, cands, replica.rng)
        except NoNodeAvailable:
            self._fail(req, req.last, now)
            return
        assert isinstance(view, _View)
        req.queued = view.effective_queue
        view.in_flight += 1
        if tried:
            replica.retrying += 1
            req.retry_try = True
            self.retries += 1
        tried.append(view.idx)
        self._send(req, self.nodes[view.idx], now, view)

    def _perfect_pick(self, arrival: Arrival, now: float, tried: list[int]) -> _Node | None:
        """Join the shortest expected delay with exact state: the node where this request
        would finish first, given every request already placed and this one's service time."""
        best = math.inf
        chosen: _Node | None = None
        nodes = self.nodes
        m = arrival.max_tokens
        p = arrival.prompt_tokens
        if tried:  # a retry (rare): a plain scan that can leave nodes out
            for group in self.group_list:
                extra = group.a + group.b * m + group.c * p
                for idx in group.members:
                    if idx in tried:
                        continue
                    free = nodes[idx].free[0]
                    done = (free if free > now else now) + extra
                    if done < best:
                        best, chosen = done, nodes[idx]
            return chosen
        for group in self.group_list:
            heap = group.heap
            while heap:
                top = heap[0]
                if nodes[top[2]].version == top[1]:
                    break
                heapq.heappop(heap)
            else:
                continue
            free = top[0]
            done = (free if free > now else now) + group.a + group.b * m + group.c * p
            if done < best:
                best = done
                chosen = nodes[top[2]]
        return chosen

    def _join_group(self, node: _Node) -> None:
        spec = node.spec
        key = (spec.ttft_ms, spec.tokens_per_s, spec.prefill_tokens_per_s, node.factor)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = _Group(spec, node.factor)
            self.group_list.append(group)
        group.members.add(node.idx)
        node.group = group
        self._reindex(node)

    def _leave_group(self, node: _Node) -> None:
        if node.group is not None:
            node.group.members.discard(node.idx)
            node.group = None
        node.version += 1  # its heap entries are stale now

    def _reindex(self, node: _Node) -> None:
        group = node.group
        if group is None:
            return
        node.version += 1
        heap = group.heap
        heapq.heappush(heap, (node.free[0], node.version, node.idx))
        if len(heap) > 4 * len(group.members) + 64:
            # Stale entries pile up below the top; rebuilding keeps the heap near its members.
            nodes = self.nodes
            group.heap = [(nodes[i].free[0], nodes[i].version, i) for i in group.members]
            heapq.heapify(group.heap)

    def _replan(self, node: _Node, now: float) -> None:
        """Recompute when each slot frees up from the node's exact state (after a fault or a
        try that ended early): the forecast `_send` keeps is exact only while nothing does."""
        if not self.perfect:
            return
        free = sorted(r.finish for r in node.active)
        free.extend([now] * (node.slots - len(free)))
        heapq.heapify(free)
        for req in node.queue:
            if req.node is node and req.phase == _QUEUED and not req.done:
                t0 = heapq.heappop(free)
                heapq.heappush(free, (t0 if t0 > now else now) + req.base * req.factor)
        node.free = free
        self._reindex(node)

    # -- the node ----------------------------------------------------------------------------
    def _send(self, req: _Req, node: _Node, now: float, view: _View | None) -> None:
        params = self.params
        req.view = view
        req.node = node
        req.sent = now
        req.try_no += 1
        req.armed = False
        req.cut = False
        req.deadline = min(now + params.per_try_timeout, req.born + params.client_timeout)
        if node.state == _CRASHED:
            req.phase = _CONNECTING
            self._push(now + params.connect_fail_s, _CONNECT_FAIL, req, req.try_no)
            return
        node.dispatched += 1
        req.factor = node.factor
        arrival = req.arrival
        if self.service is None:
            head = node.ttft + arrival.prompt_tokens * node.inv_prefill
            req.head = head
            req.base = head + arrival.max_tokens * node.inv_tps
        else:
            req.head = 0.0
            req.base = self.service(node.spec, arrival, self.service_rng)
        if node.state == _HUNG:
            # The emulator's hang: accepted, never answered, and not in the engine's counts.
            req.phase = _STUCK
            node.hung.append(req)
            req.armed = True
            self._push(req.deadline, _TIMEOUT, req, req.try_no)
            return
        self._admit(req, node, now)

    def _admit(self, req: _Req, node: _Node, now: float) -> None:
        """Into a free slot, or at the back of the FIFO queue."""
        if self.perfect:
            free = node.free
            t0 = heapq.heappop(free)
            heapq.heappush(free, (t0 if t0 > now else now) + req.base * req.factor)
            self._reindex(node)
        if node.running < node.slots:
            self._start(req, node, now)
            if node.running > node.max_depth:
                node.max_depth = node.running
        else:
            req.phase = _QUEUED
            node.queue.append(req)
            node.cur = None
            if not req.armed:
                req.armed = True
                heapq.heappush(self.heap, (req.deadline, next(self.seq), _TIMEOUT, req, req.try_no))
            depth = node.running + len(node.queue) - node.stale
            if depth > node.max_depth:
                node.max_depth = depth

    def _start(self, req: _Req, node: _Node, now: float) -> None:
        node.busy += node.running * (now - node.t_last)
        node.t_last = now
        node.running += 1
        node.cur = None
        req.phase = _RUNNING
        req.start = now
        node.active[req] = None
        if req.retry_try:  # its headers are on their way: it leaves the retry budget
            req.retry_try = False
            self.replicas[req.replica].retrying -= 1
        factor = req.factor
        finish = now + req.base * factor
        give_up = req.born + self.params.client_timeout
        if finish > give_up:
            finish = give_up
            req.cut = True
        req.finish = finish
        heapq.heappush(self.heap, (finish, next(self.seq), _FINISH, req, req.try_no))
        if not req.armed and now + req.head * factor > req.deadline:
            req.armed = True
            self._push(req.deadline, _TIMEOUT, req, req.try_no)

    def _next(self, node: _Node, now: float) -> None:
        """Hand free slots to the queue's head, FIFO, skipping tries that already ended."""
        queue = node.queue
        while queue and node.running < node.slots:
            req = queue.popleft()
            if req.node is not node or req.phase != _QUEUED or req.done:
                node.stale -= 1
                node.cur = None
                continue
            self._start(req, node, now)

    def _finish(self, t: float, req: _Req, try_no: int) -> None:
        if req.done or req.try_no != try_no or req.phase != _RUNNING or req.finish != t:
            return  # rescheduled by a slow fault, or the try already ended
        node = req.node
        assert node is not None
        node.busy += node.running * (t - node.t_last)
        node.t_last = t
        node.running -= 1
        node.cur = None
        del node.active[req]
        if req.cut:
            # The client gave up mid-stream and disconnected: the slot frees now. The gateway
            # counts an aborted request against no node.
            self._fail(req, "timeout", t)
            self._replan(node, t)
        else:
            view = req.view  # _end_try lets go of it
            self._end_try(req)
            req.done = True
            self.latencies.append(t - req.born)
            self.waits.append(req.start - req.sent)
            node.served += 1
            self.pending -= 1
            self.last_t = t
            if not self.perfect:
                replica = self.replicas[req.replica]
                route = req.route
                if route is not None and view is not None:
                    # A custom service time has no first-token split: then none is reported.
                    head = None if self.service else req.start - req.sent + req.head * req.factor
                    replica.strategy.observe(route, view, t - req.sent, head, req.queued)
                replica.active -= 1
                if replica.consecutive[node.idx]:
                    replica.consecutive[node.idx] = 0
        self._next(node, t)

    def _timeout(self, t: float, req: _Req, try_no: int) -> None:
        if req.done or req.try_no != try_no:
            return
        node = req.node
        assert node is not None
        phase = req.phase
        if phase == _RUNNING:
            if req.start + req.head * req.factor <= t:
                return  # its headers came in time
            node.integrate(t)
            node.running -= 1
            node.cur = None
            del node.active[req]
            req.phase = _CONNECTING
            self._next(node, t)
        elif phase == _QUEUED:
            node.stale += 1
            node.cur = None
            req.phase = _CONNECTING
        elif phase == _STUCK:
            node.hung.remove(req)
        self._replan(node, t)
        self._try_failed(req, "timeout", t)

    # -- replicas ----------------------------------------------------------------------------
    def _refresh(self, replica: _Replica, now: float) -> None:
        # A crashed node's ``cur`` stays the last snapshot it sent: a dead engine sends nothing.
        for node, view in zip(self.nodes, replica.views, strict=True):
            snap = node.cur
            view.snapshot = node.snapshot(now) if snap is None else snap
            view.in_flight_at_snapshot = view.in_flight
        if replica.ramping:
            self._ramp(replica, now)

    def _ramp(self, replica: _Replica, now: float) -> None:
        ramping = replica.ramping
        views = replica.views
        slow_start = self.params.slow_start
        for idx, since in list(ramping.items()):
            ramp = (now - since) / slow_start
            if ramp >= 1.0:
                views[idx].ramp = 1.0
                del ramping[idx]
            else:
                views[idx].ramp = max(_MIN_RAMP, ramp)

    def _warm(self, replica: _Replica, idx: int, now: float) -> None:
        """The node just became a candidate again: slow start from a tenth of its share."""
        if self.params.slow_start > 0:
            replica.ramping[idx] = now
            replica.views[idx].ramp = _MIN_RAMP

    def _record(self, r: int, idx: int, *, ok: bool, now: float) -> None:
        """A failed try, for outlier detection (NodeTable.record_result)."""
        limit = self.params.outlier_failures
        if ok or not limit:
            return
        replica = self.replicas[r]
        replica.consecutive[idx] += 1
        if replica.consecutive[idx] < limit or replica.ejected[idx]:
            return
        if replica.n_ejected >= self.eject_cap:
            return
        replica.consecutive[idx] = 0
        replica.times_ejected[idx] += 1
        until = now + min(_EJECTION_BASE * replica.times_ejected[idx], _EJECTION_MAX)
        replica.ejected[idx] = True
        replica.n_ejected += 1
        replica.ejected_until[idx] = until
        replica.ramping.pop(idx, None)
        self.ejections += 1
        replica.rebuild()
        self._push(until, _UNEJECT, r, idx)

    def _uneject(self, r: int, idx: int, now: float) -> None:
        replica = self.replicas[r]
        if not replica.ejected[idx] or replica.ejected_until[idx] > now:
            return
        replica.ejected[idx] = False
        replica.n_ejected -= 1
        if replica.alive[idx]:
            self._warm(replica, idx, now)
        replica.rebuild()

    def _schedule_detection(self, node: _Node, now: float, up: bool) -> None:
        """Each replica's health checks, staggered over the interval, see the change; it counts
        after ``threshold`` checks in a row. Replicas detecting at the same instant share one
        event, so that a fault on many nodes at once costs one rebuild per replica."""
        params = self.params
        interval = params.health_interval
        threshold = params.healthy_threshold if up else params.unhealthy_threshold
        count = len(self.replicas)
        for r in range(count):
            phase = interval * r / count
            first = phase + math.ceil((now - phase) / interval) * interval
            if first < now:  # float rounding
                first += interval
            at = first + (threshold - 1) * interval
            key = (r, at)
            batch = self.detect_at.get(key)
            if batch is None:
                batch = self.detect_at[key] = []
                self._push(at, _DETECT, key)
            batch.append((node.idx, up))

    def _detect(self, key: tuple[int, float], now: float) -> None:
        replica = self.replicas[key[0]]
        alive = replica.alive
        for idx, up in self.detect_at.pop(key):
            if alive[idx] == up:
                continue
            alive[idx] = up
            if up and not replica.ejected[idx]:
                self._warm(replica, idx, now)
            elif not up:
                replica.ramping.pop(idx, None)
                replica.views[idx].ramp = 1.0
        if replica.ramping:
            self._ramp(replica, now)
        replica.rebuild()

    # -- faults ------------------------------------------------------------------------------
    def _fault(self, node: _Node, fault: Fault, now: float) -> None:
        kind = fault.kind
        if kind == "crash":
            if node.state == _CRASHED:
                return
            self._drop_all(node, now)
            node.state = _CRASHED
            if self.perfect:
                self._leave_group(node)
            else:
                self._schedule_detection(node, now, up=False)
        elif kind == "hang":
            if node.state != _UP:
                return
            node.state = _HUNG  # work already admitted still completes, as in the emulator
            if self.perfect:
                self._leave_group(node)
        elif kind == "recover":
            was = node.state
            if was == _UP and node.factor == 1.0:
                return
            node.integrate(now)
            node.factor = 1.0
            node.state = _UP
            node.cur = None
            if was == _HUNG:
                # The hang is lifted: the held requests go on, in the order they came, with
                # their per-try timeouts still running.
                held, node.hung = node.hung, []
                for req in held:
                    req.factor = 1.0
                    self._admit(req, node, now)
            if self.perfect:
                self._leave_group(node)
                self._join_group(node)
                self._replan(node, now)
            elif was == _CRASHED:
                self._schedule_detection(node, now, up=True)
        elif kind == "slow":
            node.factor = fault.value if fault.value > 0 else 1.0
            if self.perfect and node.state == _UP:
                self._leave_group(node)
                self._join_group(node)
                self._replan(node, now)
        # "leak" costs memory on the real emulator, not time: nothing to simulate.

    def _drop_all(self, node: _Node, now: float) -> None:
        """A crash: streams already answering break (not retried); tries still waiting for
        their headers see a reset and are retried elsewhere, as the proxy does."""
        node.integrate(now)
        last = node.snapshot(now)  # what the replicas keep seeing until the node is back
        broken: list[_Req] = []
        reset: list[_Req] = []
        for req in node.active:
            if req.start + req.head * req.factor <= now:
                broken.append(req)
            else:
                reset.append(req)
        reset.extend(r for r in node.queue if r.node is node and r.phase == _QUEUED and not r.done)
        reset.extend(node.hung)
        node.active.clear()
        node.queue.clear()
        node.hung = []
        node.stale = 0
        node.running = 0
        node.cur = last
        for req in broken:
            if not self.perfect:
                self._record(req.replica, node.idx, ok=False, now=now)
            self._fail(req, "crash", now)
        for req in reset:
            req.phase = _CONNECTING
            self._try_failed(req, "crash", now)

    def _mark(self, now: float) -> None:
        for node in self.nodes:
            node.busy_mark = node.busy + node.running * (now - node.t_last)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> SimResult:
        started = time.perf_counter()
        arrivals = self.arrivals
        total = len(arrivals)
        heap = self.heap
        pop = heapq.heappop
        push = heapq.heappush
        count = len(self.replicas) or 1
        replicas = self.replicas
        model = self.params.model
        perfect = self.perfect
        refresh = self.params.staleness
        seq = self.seq
        i = 0
        events = 0
        next_at = arrivals[0].at if total else math.inf
        while True:
            if heap and heap[0][0] <= next_at:
                t, _, kind, obj, try_no = pop(heap)
                events += 1
                if kind == _FINISH:
                    self._finish(t, obj, try_no)
                elif kind == _TIMEOUT:
                    self._timeout(t, obj, try_no)
                elif kind == _REFRESH:
                    self._refresh(replicas[obj], t)
                    push(heap, (t + refresh, next(seq), _REFRESH, obj, 0))
                elif kind == _CONNECT_FAIL:
                    req: _Req = obj
                    if not req.done and req.try_no == try_no:
                        self._try_failed(req, "connect", t)
                elif kind == _DETECT:
                    self._detect(obj, t)
                elif kind == _UNEJECT:
                    self._uneject(obj, try_no, t)
                elif kind == _FAULT:
                    self._fault(obj[0], obj[1], t)
                elif kind == _MARK:
                    self._mark(t)
                if self.pending == 0 and i >= total:
                    break
            elif i < total:
                arrival = arrivals[i]
                r = i % count
                if perfect:
                    req = _Req(arrival, 0, None)
                else:
                    route = RouteRequest(
                        model,
                        input_tokens=arrival.prompt_tokens,
                        max_tokens=arrival.max_tokens,
                        prompt_class=arrival.prompt_class,
                        stream=True,  # as the load generator sends every request
                    )
                    req = _Req(arrival, r, route)
                    replicas[r].active += 1
                i += 1
                next_at = arrivals[i].at if i < total else math.inf
                self.pending += 1
                self._route(req, req.born)
                events += 1
            else:
                break
        for node in self.nodes:
            if node.busy_mark < 0:  # drained before the end of the trace's window
                node.busy_mark = node.busy + node.running * (self.duration - node.t_last)
        return SimResult(
            strategy=self.name,
            requests=total,
            latencies=self.latencies,
            waits=self.waits,
            errors=dict(sorted(self.errors.items())),
            retries=self.retries,
            ejections=self.ejections,
            node_names=[n.name for n in self.nodes],
            dispatched=[n.dispatched for n in self.nodes],
            served=[n.served for n in self.nodes],
            busy=[n.busy_mark for n in self.nodes],
            slots=[n.slots for n in self.nodes],
            max_depth=[n.max_depth for n in self.nodes],
            duration=self.duration,
            makespan=self.last_t,
            wall_s=time.perf_counter() - started,
            events=events,
        )


def simulate(
    nodes: Sequence[NodeSpec],
    arrivals: Sequence[Arrival],
    strategy: str,
    *,
    duration: float,
    params: SimParams | None = None,
    options: Mapping[str, Any] | None = None,
    service: ServiceFn | None = None,
) -> SimResult:
    """Replay ``arrivals`` (sorted by time) on ``nodes`` routed by ``strategy``.

    ``strategy`` is a middleware strategy name (built with ``options``), ``random`` or
    ``perfect``. ``duration`` is the trace's window: utilisation is measured within it, while the
    run goes on until every request has finished or failed. Deterministic for ``params.seed``.
    """
    if not nodes:
        raise ConfigError("nodes", [], "at least one node")
    sim = _Sim(nodes, arrivals, strategy, duration, params or SimParams(), options or {}, service)
    return sim.run()
