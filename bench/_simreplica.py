"""A middleware replica as the simulator keeps it: its strategy, its node views, and the state
of its node table (health, ejections, error rates, slow start) as indexed lists, so that an
event costs O(1)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from promptlb.middleware._affinity import Affinity
from promptlb.middleware._refusals import NoNodeAvailable
from promptlb.middleware._rules import RetryBudget
from promptlb.middleware._strategies import make_strategy
from promptlb.middleware._strategy import Static, Strategy
from promptlb.middleware._view import NodeView, RouteRequest

from ._simparams import AFFINITY, RANDOM

__all__ = ["RandomChoice", "Replica", "View", "build_strategy"]


class RandomChoice(Static):
    """A uniformly random candidate: the textbook baseline power-of-two choices is measured by.
    Not one of the middleware's strategies; only the simulator offers it."""

    name = RANDOM

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        if not candidates:
            raise NoNodeAvailable(request.model)
        return candidates[rng.randrange(len(candidates))]


class View(NodeView):
    """A `NodeView` that knows its node's index, so a pick maps back to a node in O(1)."""

    __slots__ = ("idx",)
    idx: int


class Replica:
    """One middleware replica: its strategy, its node views and its node table's state."""

    __slots__ = (
        "alive",
        "back_at",
        "budget",
        "cands",
        "consecutive",
        "eased_at",
        "ejected",
        "ejected_until",
        "faded_at",
        "leaking",
        "marks",
        "n_ejected",
        "ramping",
        "refreshes",
        "rng",
        "strategy",
        "times_ejected",
        "views",
    )

    def __init__(
        self, strategy: Strategy, rng: random.Random, views: list[View], budget: RetryBudget
    ) -> None:
        n = len(views)
        self.strategy = strategy
        self.rng = rng
        self.views = views
        self.cands: list[View] = list(views)
        self.alive = [True] * n  # by health checks
        self.ejected = [False] * n  # by outlier detection
        self.ejected_until = [0.0] * n
        self.n_ejected = 0
        self.times_ejected = [0] * n
        # Since when each node is back (its `ready_since`; None: out), and when its ejection
        # count last eased (`_rules.eases`).
        self.back_at: list[float | None] = [0.0] * n
        self.eased_at = [0.0] * n
        self.consecutive = [0] * n
        self.faded_at = [0.0] * n  # when each view's error rate was last faded to
        self.ramping: dict[int, float] = {}  # node index -> ready since
        self.refreshes = 0  # its snapshot refreshes so far (`Detection._refresh`)
        # Drained for a projected OOM: each node's `leak_mark`, and whether it holds one.
        self.marks: list[tuple[str, int] | None] = [None] * n
        self.leaking = [False] * n
        # Its ``active``: requests open on this replica; ``retrying``: retry tries waiting for
        # their headers, as Balancer.open counts them.
        self.budget = budget

    def rebuild(self) -> None:
        alive, ejected, leaking = self.alive, self.ejected, self.leaking
        views = self.views
        cands = [v for v in views if alive[v.idx] and not ejected[v.idx] and not leaking[v.idx]]
        if not cands:
            # As `NodeTable._rebuild`: a model with no ready node keeps its leaking nodes (one
            # near its OOM beats none), else its ejected ones whose health checks pass.
            cands = [v for v in views if alive[v.idx] and not ejected[v.idx]]
        if not cands:
            cands = [v for v in views if alive[v.idx] and not leaking[v.idx]]
        self.cands = cands


def build_strategy(name: str, options: Mapping[str, Any]) -> Strategy:
    """A middleware strategy by name (``X+affinity``: X under ``[affinity]`` at its defaults,
    built with X's options), or the simulator's `RandomChoice`."""
    if name == RANDOM:
        return RandomChoice()
    if name.endswith(AFFINITY):
        return Affinity(make_strategy(name.removesuffix(AFFINITY), **options))
    return make_strategy(name, **options)
