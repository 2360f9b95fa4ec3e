"""Session and prefix affinity: an option on any strategy (``[affinity]`` in the config).

Requests of one conversation, or that start with the same long prefix, should land on the node
that already holds that prefix in its KV cache. `Affinity` wraps the configured strategy and
routes keyed requests by consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
"Consistent Hashing with Bounded Loads", SODA 2018): the key's first node clockwise on a ring of
virtual nodes takes it unless that node's load is over ``(1 + epsilon)`` times the average, in
which case the key passes on to the next node. A hot key therefore spills onto its ring
neighbours instead of swamping one node, and a node leaving moves only its own keys.

Requests without a key go to the inner strategy untouched. The key is computed by `KeyMaker`
in the proxy (and the in-app client) only when affinity is configured: the default path pays
nothing.
"""

from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from promptlb.shared import ConfigError, prompt_prefix

from ._config import AffinityConfig
from ._prefix import PrefixIndex
from ._strategy import NoNodeAvailable, Scoring, Strategy, tell_placed
from ._view import NodeView, RouteRequest

__all__ = ["Affinity", "KeyMaker", "key_hash", "prompt_head"]

# Vnode hashes are remembered per node name; names found by DNS come and go, so the table is
# dropped whole past this size (recomputing a node's points costs ~64 hashes, once).
_MAX_NAMES = 4096
# Rings are cached per candidate list (a list object the node table reuses until it rebuilds
# it), and per the names in it: lists filtered per request (retries, shedding) are new objects
# each time, and each rebuilt its ring (64 nodes: 2.5 ms a pick under shedding). Both caches
# are dropped whole past this many so that they cannot pile up.
_MAX_RINGS = 64


def key_hash(text: str) -> int:
    """A stable 64-bit hash (Python's ``hash`` is salted per process, and every replica of the
    gateway must place a key on the same node)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class _Ring:
    """The sorted vnode points of one candidate list and, per point, the candidate's index."""

    __slots__ = ("owners", "points")

    def __init__(self, candidates: Sequence[NodeView], points_of: Callable[[str], list[int]]):
        pairs = sorted((p, i) for i, node in enumerate(candidates) for p in points_of(node.name))
        self.points = [p for p, _ in pairs]
        self.owners = [i for _, i in pairs]


class Affinity:
    """Keyed requests by consistent hashing with bounded loads; the rest by ``inner``.

    A node's load is `NodeView.effective_queue` over its ``weight * ramp`` (a warming node takes
    its share of keys as its ramp grows). A node may take one more request while its queue is
    below ``ceil((1 + epsilon) * (total + 1) * share)``, ``total`` the candidates' summed queue
    and ``share`` the node's part of their summed weight: with equal weights, the paper's
    ``ceil((1 + epsilon) * m / n)`` for the ``m``-th ball. The capacities sum to more than the
    total plus one, so some node always qualifies; the inner strategy is only a guard (all
    weights zero).

    ``name`` is ``"<inner>+affinity"``, so a status page tells the two apart; the pick metrics
    keep the configured strategy's name.
    """

    def __init__(self, inner: Strategy, *, epsilon: float = 0.25, vnodes: int = 64) -> None:
        if isinstance(epsilon, bool) or not isinstance(epsilon, int | float):
            raise ConfigError("epsilon", epsilon, "a finite number > 0")
        if not math.isfinite(epsilon) or epsilon <= 0:
            raise ConfigError("epsilon", epsilon, "a finite number > 0")
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or not 1 <= vnodes <= 4096:
            raise ConfigError("vnodes", vnodes, "an integer in 1..4096")
        self._inner = inner
        self.name = f"{inner.name}+affinity"
        self.epsilon = float(epsilon)
        self.vnodes = vnodes
        self._factor = 1.0 + self.epsilon
        self._points: dict[str, list[int]] = {}
        # By the list's id, with the list (whose identity makes the id sound): the table's lists
        # are new at each of its rebuilds, and each found its ring by names once only.
        self._rings: dict[int, tuple[Sequence[NodeView], _Ring]] = {}
        self._by_names: dict[tuple[str, ...], _Ring] = {}
        # Looked up once: the Strategy protocol may or may not have the hook.
        self._narrow: Callable[[RouteRequest, Sequence[NodeView]], Sequence[NodeView]] | None = (
            getattr(inner, "narrow", None)
        )

    @property
    def inner(self) -> Strategy:
        return self._inner

    @property
    def scoring(self) -> Scoring | None:
        return self._inner.scoring

    @property
    def prefix_index(self) -> PrefixIndex | None:
        return self._inner.prefix_index

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        key = request.session_key
        if key is None:
            return self._inner.pick(request, candidates, rng)
        narrow = self._narrow
        if narrow is not None:
            # model_aware's class routes hold for keyed requests too: the ring ran over every
            # candidate, and a class routed to one node was spread over all of them.
            candidates = narrow(request, candidates)
        n = len(candidates)
        if n == 0:
            raise NoNodeAvailable(request.model)
        if n == 1:
            return self._placed(request, candidates[0])
        ring = self._ring(candidates)
        total = 0
        weight = 0.0
        for node in candidates:
            total += node.effective_queue
            weight += node.weight * node.ramp
        if weight <= 0:
            return self._inner.pick(request, candidates, rng)
        # (1 + eps) * (total + 1) per unit of weight; a node's bound is this times its weight.
        per_weight = self._factor * (total + 1) / weight
        points, owners = ring.points, ring.owners
        size = len(points)
        start = bisect_right(points, key_hash(key))
        seen: set[int] = set()
        for step in range(size):
            i = owners[(start + step) % size]
            if i in seen:
                continue
            node = candidates[i]
            # The tiny slack keeps float error from rounding an exact bound (1.25 * 8) up.
            if node.effective_queue < math.ceil(per_weight * node.weight * node.ramp - 1e-9):
                return self._placed(request, node)
            seen.add(i)
            if len(seen) == n:
                break
        return self._inner.pick(request, candidates, rng)

    def _placed(self, request: RouteRequest, node: NodeView) -> NodeView:
        # Placed here, not by the inner strategy: it learns where the request went, its prefix
        # index does (and the other replicas, which the balancer tells of every try's end, of
        # its start).
        tell_placed(self._inner, request, node)
        return node

    def observe(
        self,
        request: RouteRequest,
        node: NodeView,
        latency_s: float,
        ttft_s: float | None,
        queue_at_pick: int,
    ) -> None:
        self._inner.observe(request, node, latency_s, ttft_s, queue_at_pick)

    def refused(self, request: RouteRequest, node: NodeView) -> None:
        self._inner.refused(request, node)

    def forget_node(self, name: str) -> None:
        self._inner.forget_node(name)

    def _ring(self, candidates: Sequence[NodeView]) -> _Ring:
        rings = self._rings
        found = rings.get(id(candidates))
        if found is not None and found[0] is candidates:
            return found[1]
        # Another list of the same nodes in the same order: the ring's positions hold for it.
        names = tuple(node.name for node in candidates)
        by_names = self._by_names
        ring = by_names.get(names)
        if ring is None:
            if len(by_names) >= _MAX_RINGS:
                by_names.clear()
            if len(self._points) >= _MAX_NAMES:
                self._points = {}
            ring = by_names[names] = _Ring(candidates, self._points_of)
        if len(rings) >= _MAX_RINGS:
            rings.clear()
        rings[id(candidates)] = (candidates, ring)  # found by identity next time
        return ring

    def _points_of(self, name: str) -> list[int]:
        points = self._points.get(name)
        if points is None:
            # By name, not position: every replica and every candidate list agrees on where a
            # node sits, so a node leaving or joining moves only the keys next to its points.
            points = [key_hash(f"{name}#{i}") for i in range(self.vnodes)]
            self._points[name] = points
        return points


def prompt_head(body: Mapping[str, Any], limit: int) -> str | None:
    """The first ``limit`` characters of the prompt as `prompt_prefix` lays it out (the
    emulator's prefix cache reads the same), or None when the prompt is shorter: a short prompt
    shares no prefix worth a node. Stops reading once it has them, so a long history costs no
    more than a short one."""
    head = prompt_prefix(body, limit)
    return head if len(head) >= limit else None


class KeyMaker:
    """The affinity key of a request, per `AffinityConfig`: ``s:<session>`` from the header or
    the body's ``user`` (the header wins), else ``p:<hash>`` of the prompt's first
    ``prefix_chars`` characters when it has that many, else None."""

    __slots__ = ("header", "prefix", "prefix_chars", "session")

    def __init__(self, config: AffinityConfig) -> None:
        self.header = config.header.lower().encode("latin-1") if config.header else None
        self.session = config.key in ("session", "both")
        self.prefix = config.key in ("prefix", "both")
        self.prefix_chars = config.prefix_chars

    def header_value(self, headers: Sequence[tuple[bytes, bytes]]) -> str | None:
        wanted = self.header
        if wanted is None or not self.session:
            return None
        for name, value in headers:
            if name == wanted:
                text = value.decode("latin-1").strip()
                return text or None
        return None

    def __call__(self, body: Mapping[str, Any], header: str | None = None) -> str | None:
        if self.session:
            if header:
                return "s:" + header
            user = body.get("user")
            if isinstance(user, str) and user:
                return "s:" + user
        if self.prefix:
            head = prompt_head(body, self.prefix_chars)
            if head is not None:
                return "p:" + hashlib.blake2b(head.encode(), digest_size=8).hexdigest()
        return None
