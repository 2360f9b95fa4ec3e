"""Routing strategies: which of the candidate nodes gets a request.

A strategy is a small synchronous object with a ``pick`` method and no I/O, so that the live
middleware, the unit tests and a simulator with a virtual clock all drive the very same code. The
caller has already filtered the candidates (model, health, draining); a strategy only ranks them.
Whatever state a strategy keeps (a round-robin position, smooth weighted round robin's current
weights) lives on its instance, keyed by node name, because candidate lists change between calls.

Rules every strategy keeps:

* an empty candidate set raises `NoNodeAvailable`;
* ties are broken with the ``rng`` passed in, never by list order. The node table lists nodes in
  config order, and a fixed tie-break would hand every quiet moment's traffic to the first node;
* a node whose load is unknown (no snapshot, or a stale one) is never taken for an idle one.

`make_strategy` builds one by its config name; `DEFAULT_STRATEGY` is ``predictive`` (which
behaves as ``p2c`` until it has learnt the nodes).
"""

from __future__ import annotations

import inspect
import math
import random
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import accumulate
from typing import Any, Protocol

from promptlb.shared import ConfigError, Snapshot

from ._config_base import whole_number
from ._model_aware import ModelAware
from ._predictive import Predictive
from ._view import NodeView, RouteRequest

__all__ = [
    "DEFAULT_STRATEGY",
    "DEFAULT_WEIGHTS",
    "STRATEGIES",
    "LeastConn",
    "NoNodeAvailable",
    "PowerOfTwoChoices",
    "Predictive",
    "Resource",
    "ResourceWeights",
    "RoundRobin",
    "ScoreParts",
    "Strategy",
    "Weighted",
    "make_strategy",
    "resource_score",
    "score_parts",
]

DEFAULT_STRATEGY = "predictive"

# Per-node state is forgotten once a node has not been a candidate for between one and two spans
# of picks: nodes found by DNS come and go under new names, and their state must not pile up.
# A node forgotten too eagerly (one of a rarely requested model's) merely starts afresh.
_FORGET_SPAN = 4096
_EWMA_ALPHA = 0.3  # dynamic weights: the share of the newest GPU sample in the smoothed factor
# The scanning strategies look at this many candidates at most, drawn at random above it (Envoy's
# least_request does the same with 2). Up to 64 nodes a scan is exact; at 1,000 a full one would
# cost ~140 us per request, a third of the gateway's whole CPU budget for one, while the best of
# 64 random nodes is among the best 5% of all with a probability of 96%.
DEFAULT_SAMPLE = 64
# weighted: smooth round robin (a scan per pick) up to this many candidates, a draw above; and
# the most candidate lists it keeps cumulative weights for (one per model, plus retries').
_EXACT_WEIGHTED = 64
_TABLES = 64


class NoNodeAvailable(Exception):
    """No candidate node can take a request for ``model``; answered as a 503 with Retry-After."""

    def __init__(self, model: str, reason: str = "no candidate node") -> None:
        # Both in args, so that the exception survives pickling (a simulator's worker pool).
        super().__init__(model, reason)
        self.model = model
        self.reason = reason

    def __str__(self) -> str:
        return f"no node available for model {self.model!r}: {self.reason}"


class Strategy(Protocol):
    """Picks one of ``candidates`` for ``request``. Synchronous, fast, and free of I/O."""

    name: str

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView: ...

    def observe(
        self,
        request: RouteRequest,
        node: NodeView,
        latency_s: float,
        ttft_s: float | None,
        queue_at_pick: int,
    ) -> None:
        """A try on ``node`` succeeded: ``latency_s`` to its end, ``ttft_s`` to its first body
        byte, ``queue_at_pick`` its `NodeView.effective_queue` when it was picked. Strategies
        that learn (``predictive``) learn here; the others ignore it."""


class _Static:
    """Strategies that decide from the views alone and learn nothing from outcomes."""

    def observe(
        self,
        request: RouteRequest,
        node: NodeView,
        latency_s: float,
        ttft_s: float | None,
        queue_at_pick: int,
    ) -> None:
        return None


def _at_random(
    candidates: Sequence[NodeView], values: list[float], best: float, rng: random.Random
) -> NodeView:
    """The candidate whose value is ``best``, chosen uniformly among those that tie.

    ``index`` and ``count`` run in C, so a scan pays for its Python loop once.
    """
    i = values.index(best)
    ties = values.count(best)
    if ties > 1:
        for _ in range(rng.randrange(ties)):
            i = values.index(best, i + 1)
    return candidates[i]


def _looked(candidates: Sequence[NodeView], sample: int, rng: random.Random) -> Sequence[NodeView]:
    n = len(candidates)
    if n <= sample:
        return candidates
    if n <= 4 * sample:
        # Without replacement near the threshold: 64 draws from 65 with replacement would look
        # at only ~41 distinct nodes, a worse view than the exact scan one node earlier.
        return rng.sample(candidates, sample)
    # With replacement: choices is 2-3x cheaper than sample at 64 of 1,000, and a node drawn
    # twice (one draw in ~16 at that size) only weighs double in a tie.
    return rng.choices(candidates, k=sample)


def _real(key: str, value: object, expected: str) -> float:
    # bool is an int subclass, and `true` where a number belongs is a config mistake.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(key, value, expected)
    return float(value)


class RoundRobin(_Static):
    """Each candidate in turn, whatever its load or weight."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next: int | None = None

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        n = len(candidates)
        if n == 0:
            raise NoNodeAvailable(request.model)
        i = self._next
        if i is None:
            # Replicas that start together must not all begin with the first node.
            i = rng.randrange(n)
        i %= n  # the set may have shrunk since the last pick
        self._next = i + 1
        return candidates[i]


class _Peer:
    """Smooth weighted round robin's state for one node."""

    __slots__ = ("current", "factor", "snapshot")

    def __init__(self) -> None:
        self.current = 0.0
        self.factor = 1.0
        self.snapshot: Snapshot | None = None


class Weighted(_Static):
    """nginx's smooth weighted round robin over ``weight * ramp``.

    Each pick adds every candidate's weight to its current weight, chooses the highest, and takes
    the total off the chosen one: shares follow the weights exactly, and picks of one node are
    spread out (5, 1, 1 gives a a b a c a a) rather than bunched.

    That is a scan of every candidate per pick, ~130 us at 1,000 nodes. Above 64 candidates a
    node is drawn at random in proportion to its weight instead, from a table of cumulative
    weights kept per candidate list and rebuilt every 64 picks: the shares are the weights' in
    expectation, and a pick costs a bisection.

    With ``dynamic_weights`` a node's weight is also scaled by ``1 - gpu_util``, bounded below by
    ``min_factor`` so that a busy node still gets a trickle (and so fresh evidence), and smoothed
    with an EWMA over successive snapshots. A node without fresh GPU data keeps its full weight.
    """

    name = "weighted"

    def __init__(self, *, dynamic_weights: bool = False, min_factor: float = 0.1) -> None:
        if not isinstance(dynamic_weights, bool):
            raise ConfigError("dynamic_weights", dynamic_weights, "true or false")
        factor = _real("min_factor", min_factor, "a number in (0, 1]")
        if not 0.0 < factor <= 1.0:
            raise ConfigError("min_factor", min_factor, "a number in (0, 1]")
        self.dynamic_weights = dynamic_weights
        self.min_factor = factor
        self._peers: dict[str, _Peer] = {}
        self._old_peers: dict[str, _Peer] = {}
        self._picks_left = _FORGET_SPAN
        # id(candidates) -> (the list itself, so its id stays its own; cumulative weights; the
        # picks left before the weights are read again)
        self._tables: dict[int, tuple[Sequence[NodeView], list[float], list[int]]] = {}

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        if not candidates:
            raise NoNodeAvailable(request.model)
        self._picks_left -= 1
        if self._picks_left <= 0:
            # Two generations: a peer still in use moves back into the new one on its next pick.
            self._old_peers, self._peers = self._peers, {}
            self._picks_left = _FORGET_SPAN
            self._tables = {}
        if len(candidates) > _EXACT_WEIGHTED:
            return self._drawn(candidates, rng)
        total = 0.0
        currents: list[float] = []
        for node in candidates:
            peer, weight = self._weigh(node)
            current = peer.current + weight
            peer.current = current
            currents.append(current)
            total += weight
        chosen = _at_random(candidates, currents, max(currents), rng)
        self._peers[chosen.name].current -= total
        return chosen

    def _drawn(self, candidates: Sequence[NodeView], rng: random.Random) -> NodeView:
        key = id(candidates)
        table = self._tables.get(key)
        if table is None or table[0] is not candidates or table[2][0] <= 0:
            # The balancer's candidate lists live until the node set changes; a retry's list
            # (the tried nodes left out) is new each time and pays for one scan.
            if len(self._tables) >= _TABLES:
                self._tables = {}
            weigh = self._weigh
            table = (
                candidates,
                list(accumulate(weigh(node)[1] for node in candidates)),
                [_EXACT_WEIGHTED],
            )
            self._tables[key] = table
        table[2][0] -= 1
        cumulative = table[1]
        total = cumulative[-1]
        if total <= 0.0:  # every weight is zero: any of them, rather than none
            return candidates[rng.randrange(len(candidates))]
        # A zero-weight node adds nothing to the running sum, so no draw lands on it.
        return candidates[bisect_right(cumulative, rng.random() * total)]

    def _weigh(self, node: NodeView) -> tuple[_Peer, float]:
        """The node's state and its weight now: ``weight * ramp``, times its GPU factor."""
        peer = self._peers.get(node.name)
        if peer is None:
            peer = self._old_peers.pop(node.name, None)
            if peer is None:
                peer = _Peer()
                if self.dynamic_weights:  # a new node starts from its first sample, not 1
                    peer.factor = self._factor(node.gpu_util)
                    peer.snapshot = node.snapshot
            self._peers[node.name] = peer
        weight = node.weight * node.ramp
        if self.dynamic_weights:
            if node.snapshot is not peer.snapshot:
                # One EWMA step per new snapshot, not per pick: the snapshot is the sample,
                # and stepping per pick would smooth less the busier the middleware is.
                peer.snapshot = node.snapshot
                gpu = node.gpu_util
                if gpu is None:
                    peer.factor = 1.0
                else:
                    peer.factor += _EWMA_ALPHA * (self._factor(gpu) - peer.factor)
            weight *= peer.factor
        return peer, weight

    def _factor(self, gpu: float | None) -> float:
        if gpu is None:
            return 1.0
        return min(1.0, max(self.min_factor, 1.0 - gpu))


class LeastConn(_Static):
    """The fewest requests per unit of weight: ours in flight plus the others' the engine reported
    (`NodeView.effective_queue`), over ``weight * ramp``; among ``sample`` random candidates when
    there are more."""

    name = "least_conn"

    def __init__(self, *, sample: int = DEFAULT_SAMPLE) -> None:
        self.sample = whole_number("sample", sample, 2)

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        if not candidates:
            raise NoNodeAvailable(request.model)
        looked = _looked(candidates, self.sample, rng)
        loads: list[float] = []
        for node in looked:
            # NodeView.effective_queue, inlined: its two nested properties and max() cost three
            # times the rest of this loop. A test holds the two to the same answer.
            queue = node.in_flight
            snap = node.snapshot
            if snap is not None and (engine := snap.engine) is not None:
                others = engine.running + engine.waiting - node.in_flight_at_snapshot
                if others > 0:
                    queue += others
            capacity = node.weight * node.ramp
            # A zero weight is a node meant to get nothing while any other can take the request.
            loads.append(queue / capacity if capacity > 0 else math.inf)
        best = min(loads)
        if best == math.inf and looked is not candidates:
            # The sample drew only zero-weight nodes: one meant to get nothing while any other
            # can take the request must not get it because the draw missed the others.
            usable = [node for node in candidates if node.weight * node.ramp > 0]
            if usable:
                return self.pick(request, usable, rng)
        return _at_random(looked, loads, best, rng)


@dataclass(frozen=True, slots=True)
class ResourceWeights:
    """The resource score's weights. A table in the config replaces the defaults whole: a key it
    leaves out weighs 0."""

    gpu: float = 0.4
    cpu: float = 0.3
    mem: float = 0.2
    queue: float = 0.1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            number = _real(f"weights.{f.name}", value, "a finite number >= 0")
            if number < 0:
                raise ConfigError(f"weights.{f.name}", value, "a finite number >= 0")
            object.__setattr__(self, f.name, number)
        if self.gpu + self.cpu + self.mem + self.queue <= 0:
            raise ConfigError("weights", self.as_dict(), "at least one weight above 0")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> ResourceWeights:
        if not isinstance(raw, Mapping):
            raise ConfigError("weights", raw, "a table of gpu, cpu, mem and queue")
        known = {f.name for f in fields(cls)}
        for key, value in raw.items():
            if key not in known:
                raise ConfigError(f"weights.{key}", value, "only gpu, cpu, mem and queue")
        return cls(**{name: raw.get(name, 0.0) for name in known})

    def as_dict(self) -> dict[str, float]:
        return {"gpu": self.gpu, "cpu": self.cpu, "mem": self.mem, "queue": self.queue}


DEFAULT_WEIGHTS = ResourceWeights()


@dataclass(frozen=True, slots=True)
class ScoreParts:
    """What a node's resource score is made of, for the status page. A part the node does not
    report is ``None`` and left out of the score, whose weights are then renormalised."""

    known: bool  # False: no trusted snapshot, and ``score`` is the configured unknown_score
    gpu: float | None  # mean utilisation of the node's GPUs, 0..1
    cpu: float | None
    mem: float | None
    queue: int | None  # requests counted as the node's queue
    queue_norm: float | None  # queue / (queue + queue_scale), 0..1
    score: float  # 0..1, lower is better
    cost: float  # 1 - (1 - score) * ramp: what the strategies compare


def _combine(
    weights: ResourceWeights,
    gpu: float | None,
    cpu: float | None,
    mem: float | None,
    queue_norm: float | None,
    unknown_score: float,
) -> float:
    total = 0.0
    weight = 0.0
    if gpu is not None:
        total += weights.gpu * gpu
        weight += weights.gpu
    if cpu is not None:
        total += weights.cpu * cpu
        weight += weights.cpu
    if mem is not None:
        total += weights.mem * mem
        weight += weights.mem
    if queue_norm is not None:
        total += weights.queue * queue_norm
        weight += weights.queue
    # Nothing the weights care about was measured: as good as no evidence at all.
    return total / weight if weight > 0 else unknown_score


def resource_score(
    node: NodeView,
    weights: ResourceWeights = DEFAULT_WEIGHTS,
    queue_scale: float = 8.0,
    unknown_score: float = 0.5,
    queue: int | None = None,
) -> float:
    """The weighted mean of the node's GPU, CPU, memory and queue load, 0..1, lower is better.

    ``queue`` overrides the engine's reported queue (p2c passes `NodeView.effective_queue`).
    Ramp is not applied here; see `score_parts` for the cost that strategies compare.
    """
    snap = node.snapshot
    if snap is None:
        return _unknown(unknown_score, queue, queue_scale)
    q = node.engine_queue if queue is None else queue
    return _combine(
        weights,
        node.gpu_util,
        snap.cpu,
        snap.mem,
        None if q is None else q / (q + queue_scale),
        unknown_score,
    )


def score_parts(
    node: NodeView,
    weights: ResourceWeights = DEFAULT_WEIGHTS,
    queue_scale: float = 8.0,
    unknown_score: float = 0.5,
    queue: int | None = None,
) -> ScoreParts:
    """`resource_score` with its parts, and the ramp-adjusted cost."""
    snap = node.snapshot
    if snap is None:
        return ScoreParts(
            known=False,
            gpu=None,
            cpu=None,
            mem=None,
            queue=None,
            queue_norm=None,
            score=_unknown(unknown_score, queue, queue_scale),
            cost=_ramped(_unknown(unknown_score, queue, queue_scale), node.ramp),
        )
    q = node.engine_queue if queue is None else queue
    queue_norm = None if q is None else q / (q + queue_scale)
    gpu = node.gpu_util
    score = _combine(weights, gpu, snap.cpu, snap.mem, queue_norm, unknown_score)
    return ScoreParts(
        known=True,
        gpu=gpu,
        cpu=snap.cpu,
        mem=snap.mem,
        queue=q,
        queue_norm=queue_norm,
        score=score,
        cost=_ramped(score, node.ramp),
    )


def _unknown(unknown_score: float, queue: int | None, queue_scale: float) -> float:
    """No trusted snapshot: the configured prior, rising with the requests we know we sent,
    so that p2c does not pour traffic into a node whose load it cannot see."""
    if not queue:
        return unknown_score
    return unknown_score + (1.0 - unknown_score) * queue / (queue + queue_scale)


def _ramped(score: float, ramp: float) -> float:
    # Slow start shrinks a node's headroom (1 - score) by its ramp: an idle warming node then
    # costs 1 - ramp instead of 0, so it takes a growing share instead of all of it.
    return 1.0 - (1.0 - score) * min(1.0, max(0.0, ramp))


class _Scored(_Static):
    """The options that the resource score and p2c share, checked once."""

    def __init__(
        self,
        *,
        weights: Mapping[str, Any] | None = None,
        queue_scale: float = 8.0,
        unknown_score: float = 0.5,
    ) -> None:
        self.weights = DEFAULT_WEIGHTS if weights is None else ResourceWeights.from_mapping(weights)
        self.queue_scale = _real("queue_scale", queue_scale, "a finite number > 0")
        if self.queue_scale <= 0:
            raise ConfigError("queue_scale", queue_scale, "a finite number > 0")
        self.unknown_score = _real("unknown_score", unknown_score, "a number in (0, 1]")
        # Zero would make a node we know nothing about the most attractive of all.
        if not 0.0 < self.unknown_score <= 1.0:
            raise ConfigError("unknown_score", unknown_score, "a number in (0, 1]")


class Resource(_Scored):
    """The lowest resource score (see `resource_score`) over ramp, from the engine's own queue;
    among ``sample`` random candidates when there are more.

    The score depends on the snapshot alone, so it is computed once per snapshot and node: a scan
    then costs a dict lookup and a division per node.
    """

    name = "resource"

    def __init__(
        self,
        *,
        weights: Mapping[str, Any] | None = None,
        queue_scale: float = 8.0,
        unknown_score: float = 0.5,
        sample: int = DEFAULT_SAMPLE,
    ) -> None:
        super().__init__(weights=weights, queue_scale=queue_scale, unknown_score=unknown_score)
        self.sample = whole_number("sample", sample, 2)
        self._scores: dict[str, tuple[Snapshot, float]] = {}
        self._picks_left = _FORGET_SPAN

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        if not candidates:
            raise NoNodeAvailable(request.model)
        self._picks_left -= 1
        if self._picks_left <= 0:
            # A cache, not state: dropping it costs one recomputation per node, and no stale
            # node's entry can outlive a span.
            self._scores = {}
            self._picks_left = _FORGET_SPAN
        looked = _looked(candidates, self.sample, rng)
        scores = self._scores
        get = scores.get
        unknown = self.unknown_score
        costs: list[float] = []
        for node in looked:
            snap = node.snapshot
            if snap is None:
                score = unknown
            else:
                hit = get(node.name)
                if hit is not None and hit[0] is snap:
                    score = hit[1]
                else:
                    score = resource_score(node, self.weights, self.queue_scale, unknown)
                    # Holding the snapshot keeps the identity test sound: no new object can
                    # reuse the id of one still referenced.
                    scores[node.name] = (snap, score)
            # _ramped, inlined: a call per node is a third of a 1,000-node scan.
            costs.append(1.0 - (1.0 - score) * node.ramp)
        return _at_random(looked, costs, min(costs), rng)


class PowerOfTwoChoices(_Scored):
    """Power of two choices: two candidates at random, the one with the lower cost wins.

    The cost is the resource score over ramp, with the queue taken as `NodeView.effective_queue`:
    the requests sent since the snapshot count, so a burst between two snapshots spreads out
    instead of piling onto the node that looked idle. Two random candidates rather than the best
    of all keeps replicas that share the same stale view from herding onto one node, and costs
    the same at 1,000 nodes as at 2.
    """

    name = "p2c"

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        n = len(candidates)
        if n == 0:
            raise NoNodeAvailable(request.model)
        if n == 1:
            return candidates[0]
        first, second = rng.sample(candidates, 2)
        # sample's order is itself random, so keeping the first on a tie is a fair coin.
        return second if self._cost(second) < self._cost(first) else first

    def _cost(self, node: NodeView) -> float:
        score = resource_score(
            node, self.weights, self.queue_scale, self.unknown_score, node.effective_queue
        )
        return _ramped(score, node.ramp)


STRATEGIES: dict[str, Callable[..., Strategy]] = {
    RoundRobin.name: RoundRobin,
    Weighted.name: Weighted,
    LeastConn.name: LeastConn,
    Resource.name: Resource,
    PowerOfTwoChoices.name: PowerOfTwoChoices,
    ModelAware.name: ModelAware,
    Predictive.name: Predictive,
}


def make_strategy(name: str, **options: Any) -> Strategy:
    """The strategy called ``name``, built with ``options`` (the config's strategy_options).

    Raises `ConfigError` (a `ValueError`) for an unknown name, an unknown option or a bad value.
    """
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ConfigError("strategy", name, "one of " + ", ".join(sorted(STRATEGIES)))
    factory = STRATEGIES[name]
    accepted = list(inspect.signature(factory).parameters)
    for key, value in options.items():
        if key not in accepted:
            takes = ", ".join(accepted) if accepted else "none"
            raise ConfigError(key, value, f"an option of {name!r} (its options: {takes})")
    return factory(**options)
