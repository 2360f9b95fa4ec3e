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

This module holds what they share: the protocol, the static base, sampling helpers and the
score settings. The registry (``_strategies``) builds them by name.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from promptlb.shared import ConfigError

from ._prefix import PrefixIndex
from ._refusals import NoNodeAvailable
from ._view import NodeView, RouteRequest

__all__ = [
    "DEFAULT_SAMPLE",
    "DEFAULT_WEIGHTS",
    "FORGET_SPAN",
    "NoNodeAvailable",
    "ResourceWeights",
    "Scoring",
    "Static",
    "Strategy",
    "at_random",
    "distinct_sample",
    "real",
    "sample_of",
    "tell_placed",
]

# Per-node state is forgotten once a node has not been a candidate for between one and two spans
# of picks: nodes found by DNS come and go under new names, and their state must not pile up.
# A node forgotten too eagerly (one of a rarely requested model's) merely starts afresh.
FORGET_SPAN = 4096
_EWMA_ALPHA = 0.3  # dynamic weights: the share of the newest GPU sample in the smoothed factor
# The scanning strategies look at this many candidates at most, drawn at random above it (Envoy's
# least_request does the same with 2). Up to 64 nodes a scan is exact; at 1,000 a full one would
# cost ~140 us per request, a third of the gateway's whole CPU budget for one, while the best of
# 64 random nodes is among the best 5% of all with a probability of 96%.
DEFAULT_SAMPLE = 64


class Strategy(Protocol):
    """Picks one of ``candidates`` for ``request``. Synchronous, fast, and free of I/O."""

    name: str

    @property
    def scoring(self) -> Scoring | None:
        """The resource-score settings the strategy ranks by (a wrapper: its inner
        strategy's), for the status page; None when it does not score."""

    @property
    def prefix_index(self) -> PrefixIndex | None:
        """The index of prompt prefixes sent to each node, for the replicas to share (a
        wrapper: its inner strategy's); None when the strategy keeps none."""

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

    def refused(self, request: RouteRequest, node: NodeView) -> None:
        """A try on ``node`` ended in a refusal (a 4xx but 429: a key it does not take, a model
        it lacks, or the request's own fault): no failure, and nothing to learn from.
        ``predictive`` looks at a node that refuses every try less and less; the others ignore
        it."""

    def forget_node(self, name: str) -> None:
        """Node ``name`` left the table (removed, or its name now another server's): what was
        learnt of it goes, or a server that takes the name later would inherit it."""


def tell_placed(strategy: Strategy, request: RouteRequest, node: NodeView) -> None:
    """A wrapper placed ``request`` on ``node`` itself (``[affinity]``'s ring): ``strategy``
    learns of it as of a pick of its own when it can (``placed``: ``predictive``, or a wrapper
    passing it on), else its prefix index records where the prompt went."""
    hook = getattr(strategy, "placed", None)
    if hook is not None:
        hook(request, node)
    elif (index := strategy.prefix_index) is not None:
        index.placed(node, request.blocks)


class Static:
    """Strategies that decide from the views alone and learn nothing from outcomes."""

    scoring: Scoring | None = None
    prefix_index: PrefixIndex | None = None

    def observe(
        self,
        request: RouteRequest,
        node: NodeView,
        latency_s: float,
        ttft_s: float | None,
        queue_at_pick: int,
    ) -> None:
        return None

    def refused(self, request: RouteRequest, node: NodeView) -> None:
        return None

    def forget_node(self, name: str) -> None:
        return None


def at_random(
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


def distinct_sample(
    candidates: Sequence[NodeView], sample: int, rng: random.Random
) -> list[NodeView]:
    """``sample`` of the candidates (fewer than there are), each at most once. A partial
    Fisher-Yates on floats: random.sample's integer draws cost twice as much (16 of 64: 8 us ->
    4.7 us), and a float's bias over fewer than 2**40 candidates is nil."""
    pool = list(candidates)
    rand = rng.random
    looked: list[NodeView] = []
    n = len(pool)
    for i in range(n - 1, n - 1 - sample, -1):
        j = int(rand() * (i + 1))
        looked.append(pool[j])
        pool[j] = pool[i]
    return looked


def sample_of(
    candidates: Sequence[NodeView], sample: int, rng: random.Random
) -> Sequence[NodeView]:
    n = len(candidates)
    if n <= sample:
        return candidates
    if n <= 4 * sample:
        # Without replacement near the threshold: 64 draws from 65 with replacement would look
        # at only ~41 distinct nodes, a worse view than the exact scan one node earlier.
        return distinct_sample(candidates, sample, rng)
    # With replacement: choices is 2-3x cheaper than sample at 64 of 1,000, and a node drawn
    # twice (one draw in ~16 at that size) only weighs double in a tie.
    return rng.choices(candidates, k=sample)


def real(key: str, value: object, expected: str) -> float:
    # bool is an int subclass, and `true` where a number belongs is a config mistake.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(key, value, expected)
    return float(value)


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
            number = real(f"weights.{f.name}", value, "a finite number >= 0")
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
class Scoring:
    """The options that the resource score and every strategy ranking by it share."""

    weights: ResourceWeights = DEFAULT_WEIGHTS
    queue_scale: float = 8.0
    unknown_score: float = 0.5
    # The queue the strategy scores by: the engine's as its snapshot says (``resource``), or
    # `NodeView.effective_queue` (``p2c``): the status page shows the cost the strategy used.
    engine_queue_only: bool = False

    @classmethod
    def from_options(
        cls,
        weights: Mapping[str, Any] | None = None,
        queue_scale: float = 8.0,
        unknown_score: float = 0.5,
    ) -> Scoring:
        scale = real("queue_scale", queue_scale, "a finite number > 0")
        if scale <= 0:
            raise ConfigError("queue_scale", queue_scale, "a finite number > 0")
        unknown = real("unknown_score", unknown_score, "a number in (0, 1]")
        # Zero would make a node we know nothing about the most attractive of all.
        if not 0.0 < unknown <= 1.0:
            raise ConfigError("unknown_score", unknown_score, "a number in (0, 1]")
        chosen = DEFAULT_WEIGHTS if weights is None else ResourceWeights.from_mapping(weights)
        return cls(chosen, scale, unknown)
