"""The strategies that need no score: round robin, smooth weighted round robin, least
connections."""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

from promptlb.shared import ConfigError, Snapshot

from ._config_base import whole_number
from ._strategy import (
    DEFAULT_SAMPLE,
    FORGET_SPAN,
    NoNodeAvailable,
    Static,
    at_random,
    real,
    sample_of,
)
from ._view import NodeView, RouteRequest

__all__ = ["LeastConn", "RoundRobin", "Weighted"]

_EWMA_ALPHA = 0.3  # dynamic weights: the share of the newest GPU sample in the smoothed factor
# weighted: smooth round robin (a scan per pick) up to this many candidates, a draw above; and
# the most candidate lists it keeps cumulative weights for (one per model, plus retries').
_EXACT_WEIGHTED = 64
_TABLES = 64
_TURNS = 1024  # round robin's turns kept, one per model


class RoundRobin(Static):
    """Each candidate in turn, whatever its load or weight."""

    name = "round_robin"

    def __init__(self) -> None:
        # A turn per model: one counter over every model sent a RAG app's embeddings call and
        # its chat call to the even and the odd places of their two nodes each, and half the
        # nodes got nothing, for good. (Per model and class, two classes' turns started alike
        # and landed on one node together; a retry's shorter list shares its model's turn.)
        self._next: dict[str | tuple[str, str], int] = {}

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        return self.pick_in_group("", request, candidates, rng)

    def pick_in_group(
        self,
        group: str,
        request: RouteRequest,
        candidates: Sequence[NodeView],
        rng: random.Random,
    ) -> NodeView:
        """`pick` among candidates a wrapper narrowed to ``group`` (model_aware's route): a turn
        of their own. Sharing the model's, classes that alternate landed each on the same place
        of its own list, and half of each list's nodes got nothing. (Classes that share one
        list keep one turn: from two, they met on one node; plain round robin's p99 on the
        class-tagged scenarios went 37.8 -> 41.9 s.)"""
        n = len(candidates)
        if n == 0:
            raise NoNodeAvailable(request.model)
        turns = self._next
        key = (request.model, group) if group else request.model
        i = turns.get(key)
        if i is None:
            if len(turns) >= _TURNS:  # model names are the clients' (nodes may take any)
                turns.clear()
            # Replicas that start together must not all begin with the first node.
            i = rng.randrange(n)
        i %= n  # the set may have shrunk since the last pick
        turns[key] = i + 1
        return candidates[i]


class _Peer:
    """Smooth weighted round robin's state for one node."""

    __slots__ = ("current", "factor", "snapshot")

    def __init__(self) -> None:
        self.current = 0.0
        self.factor = 1.0
        self.snapshot: Snapshot | None = None


class Weighted(Static):
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
        factor = real("min_factor", min_factor, "a number in (0, 1]")
        if not 0.0 < factor <= 1.0:
            raise ConfigError("min_factor", min_factor, "a number in (0, 1]")
        self.dynamic_weights = dynamic_weights
        self.min_factor = factor
        self._peers: dict[str, _Peer] = {}
        self._old_peers: dict[str, _Peer] = {}
        self._picks_left = FORGET_SPAN
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
            self._picks_left = FORGET_SPAN
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
        chosen = at_random(candidates, currents, max(currents), rng)
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


class LeastConn(Static):
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
        looked = sample_of(candidates, self.sample, rng)
        loads: list[float] = []
        unseen: list[int] = []  # places of nodes whose others' load no snapshot tells
        seen_others = 0.0  # the others' requests per unit of capacity, over the nodes seen
        seen = 0
        for node in looked:
            # NodeView.effective_queue, inlined: reading the property for each candidate took
            # a 64-node pick from 12.5 to 16.7 us, and would take a full scan of 1,000 past its
            # 200 us goal. A test holds the two to the same answer.
            queue = node.in_flight
            capacity = node.weight * node.ramp
            snap = node.snapshot
            if snap is not None and (engine := snap.engine) is not None:
                others = engine.running + engine.waiting - node.in_flight_at_snapshot
                others += node.others_since_snapshot
                if others > 0:
                    queue += others
                    if capacity > 0:
                        seen_others += others / capacity
                seen += 1
            else:
                unseen.append(len(loads))
            # A zero weight is a node meant to get nothing while any other can take the request.
            loads.append(queue / capacity if capacity > 0 else math.inf)
        if unseen and seen:
            # Unknown load is never idle: a node without a snapshot (its sidecar gone, or none)
            # carries the others' mean besides ours, or it read nearly idle beside nodes whose
            # queues it could see, and drew the bulk of the traffic (18 of 40 picks in five).
            mean = seen_others / seen
            for i in unseen:
                loads[i] += mean
        best = min(loads)
        if best == math.inf and looked is not candidates:
            # The sample drew only zero-weight nodes: one meant to get nothing while any other
            # can take the request must not get it because the draw missed the others.
            usable = [node for node in candidates if node.weight * node.ramp > 0]
            if usable:
                return self.pick(request, usable, rng)
        return at_random(looked, loads, best, rng)
