"""The resource score (GPU, CPU, memory and queue against their weights, lower is better) and
the strategies that compare it: ``resource`` over every sampled candidate, ``p2c`` over two."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from promptlb.shared import Snapshot

from ._config_base import whole_number
from ._strategy import (
    DEFAULT_SAMPLE,
    DEFAULT_WEIGHTS,
    FORGET_SPAN,
    NoNodeAvailable,
    ResourceWeights,
    Scoring,
    Static,
    at_random,
    sample_of,
)
from ._view import NodeView, RouteRequest

__all__ = ["PowerOfTwoChoices", "Resource", "ScoreParts", "resource_score", "score_parts"]


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
        return _unknown(unknown_score, node.in_flight if queue is None else queue, queue_scale)
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
        score = _unknown(unknown_score, node.in_flight if queue is None else queue, queue_scale)
        return ScoreParts(
            known=False,
            gpu=None,
            cpu=None,
            mem=None,
            queue=None,
            queue_norm=None,
            score=score,
            cost=_ramped(score, node.ramp),
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
    so that no strategy pours traffic into a node whose load it cannot see (a flat prior
    drew every pick of resource's while the others scored above it)."""
    if not queue:
        return unknown_score
    return unknown_score + (1.0 - unknown_score) * queue / (queue + queue_scale)


def _ramped(score: float, ramp: float) -> float:
    # Slow start shrinks a node's headroom (1 - score) by its ramp: an idle warming node then
    # costs 1 - ramp instead of 0, so it takes a growing share instead of all of it.
    return 1.0 - (1.0 - score) * min(1.0, max(0.0, ramp))


class _Scored(Static):
    """The options that the resource score and p2c share, checked once."""

    def __init__(
        self,
        *,
        weights: Mapping[str, Any] | None = None,
        queue_scale: float = 8.0,
        unknown_score: float = 0.5,
    ) -> None:
        self.scoring: Scoring | None = Scoring.from_options(weights, queue_scale, unknown_score)
        # Plain attributes as well: the scans read them per node.
        self.weights = self.scoring.weights
        self.queue_scale = self.scoring.queue_scale
        self.unknown_score = self.scoring.unknown_score


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
        assert self.scoring is not None
        self.scoring = replace(self.scoring, engine_queue_only=True)  # the snapshot alone
        self.sample = whole_number("sample", sample, 2)
        self._scores: dict[str, tuple[Snapshot, float]] = {}
        self._picks_left = FORGET_SPAN

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
            self._picks_left = FORGET_SPAN
        looked = sample_of(candidates, self.sample, rng)
        scores = self._scores
        get = scores.get
        unknown = self.unknown_score
        costs: list[float] = []
        for node in looked:
            snap = node.snapshot
            if snap is None:  # resource_score's rule, inlined as the rest of the loop
                score = _unknown(unknown, node.in_flight, self.queue_scale)
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
        return at_random(looked, costs, min(costs), rng)


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
