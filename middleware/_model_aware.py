"""``model_aware``: route each prompt class to the nodes tagged for it, then let an inner
strategy pick among them. Pure, like every strategy: the class is already on the request."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from promptlb.shared import ConfigError

from ._prefix import PrefixIndex
from ._strategy import Scoring, Strategy, tell_placed
from ._view import NodeView, RouteRequest

__all__ = ["ModelAware"]


class ModelAware:
    """``routes`` maps a class to node tags (or node names); ``default`` applies to classes
    with no route or no matching node (empty: every candidate); ``inner`` picks among them."""

    name = "model_aware"

    def __init__(
        self,
        inner: Strategy,
        *,
        routes: Mapping[str, Sequence[str]] | None = None,
        default: Sequence[str] = (),
    ) -> None:
        table: dict[str, frozenset[str]] = {}
        if routes is not None and not isinstance(routes, Mapping):
            raise ConfigError("routes", routes, "a table of class = [node tags or names]")
        for cls, tags in (routes or {}).items():
            if not _names(tags):
                raise ConfigError(f"routes.{cls}", tags, "a list of node tags or names")
            table[cls] = frozenset(tags)
        if not _names(default, empty=True):
            raise ConfigError("default", default, "a list of node tags or names")
        self._routes = table
        self._default = frozenset(default)
        self.inner = inner
        self._narrowed: dict[
            tuple[str, str], tuple[Sequence[NodeView], Sequence[NodeView], str]
        ] = {}
        # An inner strategy that keeps state per list of candidates (round robin's turn) is
        # told which route's list it is given.
        self._in_group: _GroupPick | None = getattr(inner, "pick_in_group", None)

    @property
    def scoring(self) -> Scoring | None:
        return self.inner.scoring

    @property
    def prefix_index(self) -> PrefixIndex | None:
        return self.inner.prefix_index

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        narrowed, group = self._narrow(request, candidates)
        if group and self._in_group is not None:
            return self._in_group(group, request, narrowed, rng)
        return self.inner.pick(request, narrowed, rng)

    def placed(self, request: RouteRequest, node: NodeView) -> None:
        """A wrapper placed ``request`` itself: told on to the inner strategy."""
        tell_placed(self.inner, request, node)

    def narrow(self, request: RouteRequest, candidates: Sequence[NodeView]) -> Sequence[NodeView]:
        """The candidates of ``request``'s class: its route's nodes, else the default's, else
        all. A wrapper that places requests itself (``[affinity]``) narrows by it first.

        Kept per model and class while the table hands the same list (it builds a new one on a
        change): a scan of 1,000 nodes a request, and a new list object each time, which the inner
        strategy's own per-list state (weighted's cumulative weights) rebuilt on every pick
        (165 us where 3 us with a kept list)."""
        return self._narrow(request, candidates)[0]

    def _narrow(
        self, request: RouteRequest, candidates: Sequence[NodeView]
    ) -> tuple[Sequence[NodeView], str]:
        """`narrow`, and the group its list is: the class (its route), ``"*"`` (the default
        route) or ``""`` (every candidate)."""
        cls = request.prompt_class
        # By model too: the table hands each model its own list, and two models interleaving
        # (chat and embeddings: one class by default) evicted each other's at every pick
        # (129 us a pick at 1,000 nodes, where 2.6 us with one model).
        key = (request.model, cls)
        kept = self._narrowed.get(key)
        if kept is not None and kept[0] is candidates:
            return kept[1], kept[2]
        chosen: Sequence[NodeView] = ()
        group = ""
        wanted = self._routes.get(cls)
        if wanted:
            chosen = _matching(candidates, wanted)
            group = cls
        if not chosen and self._default:
            chosen = _matching(candidates, self._default)
            group = "*"
        if not chosen:
            chosen, group = candidates, ""
        if len(self._narrowed) >= _CLASSES_KEPT:  # cleared at a bound: any model name may come
            self._narrowed.clear()
        # Holding the list keeps the identity test sound: no new list can reuse its id.
        self._narrowed[key] = (candidates, chosen, group)
        return chosen, group

    def observe(
        self,
        request: RouteRequest,
        node: NodeView,
        latency_s: float,
        ttft_s: float | None,
        queue_at_pick: int,
    ) -> None:
        self.inner.observe(request, node, latency_s, ttft_s, queue_at_pick)

    def refused(self, request: RouteRequest, node: NodeView) -> None:
        self.inner.refused(request, node)

    def forget_node(self, name: str) -> None:
        self.inner.forget_node(name)


_CLASSES_KEPT = 64
# `RoundRobin.pick_in_group`: a pick among the candidates of one route.
_GroupPick = Callable[[str, RouteRequest, Sequence[NodeView], random.Random], NodeView]


def _names(value: object, *, empty: bool = False) -> bool:
    """Whether ``value`` is a list of node tags or names (a bare string is one tag mistyped),
    empty only where ``empty`` (a class's empty list routed nowhere, silently the default)."""
    return (
        isinstance(value, list | tuple | set | frozenset)
        and (empty or len(value) > 0)
        and all(isinstance(t, str) and t for t in value)
    )


def _matching(candidates: Sequence[NodeView], wanted: frozenset[str]) -> list[NodeView]:
    return [c for c in candidates if c.name in wanted or not c.tags.isdisjoint(wanted)]
