"""An approximate index of the prompt prefixes this middleware sent to each node, so that a
strategy can tell how much of a prompt a node most likely holds in its KV cache.

The prompt is hashed by the engine's own rule (`promptlb.shared._kv`: the chat template's
rendering, chained block hashes), coarsened to one hash per ``INDEX_BLOCKS`` engine blocks (256
tokens): the hash at a coarse block names the whole prefix up to it, so a node's match is the
deepest coarse block it was sent, and an 8,000-token prompt costs 31 hashes, not 500 (a match
is then short by up to 255 tokens, a small error against prompts long enough to matter).

What it holds, and how it forgets (the guards that keep it close to the node's real cache):
- per node, the coarse blocks sent there and when; a node holds at most ``capacity`` of them
  (the configured bound), the least recently sent going first, and, once its snapshots show
  its KV use, about as many as fit: our blocks over its KV use is its capacity as far as our
  traffic goes, so when its cache is full, ours is trimmed to what it can hold;
- entries not sent again for ``ttl`` (in the caller's clock) do not match;
- a node that restarts (a new ``boot`` in its snapshot) starts empty.
Memory: one dict entry per coarse block and node (about 100 bytes; `bench/pick_bench.py`);
``capacity`` bounds it per node.

Replicas that share (`share`): each keeps an outbox of what it recorded, and `learn` takes what
the others recorded, stamped just after this index's own clock at its last record, in the order
learnt (each replica's clock is its own count of picks), and bounded per node by that node's
snapshot as its own records are. The same records, with the ends of the tries they started
(`finished`, `learn_finishes`), keep each node's `NodeView.others_since_snapshot`: the other
replicas' requests on it that its last snapshot does not show. What moves them, Redis or the
simulator, is not here.

The index is what a strategy shares with the other replicas, so the exchange moves one object's
outboxes: a strategy that learns from answers (``predictive``) also passes its readings through
it (`tell`, `readings`), and takes the others' from `learn_readings` by the hook it sets,
``on_reading``. Each replica alone learns a node's service time from 1/N of the answers.
"""
# Over 350 lines: the index and what it hands the other replicas (records, readings, ends) are
# one node state read by one strategy; the exchange's transport is _share.

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from itertools import count
from typing import Any

from promptlb.shared import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    BYTES_PER_TOKEN,
    block_hashes,
    first_ids,
    prompt_bytes,
)

from ._view import NodeView

__all__ = [
    "INDEX_BLOCKS",
    "INDEX_BYTES",
    "INDEX_TOKENS",
    "OUTBOX_RECORDS",
    "PrefixIndex",
    "Reading",
    "body_blocks",
    "prompt_blocks",
]

INDEX_BLOCKS = 16  # engine blocks per coarse block
INDEX_TOKENS = INDEX_BLOCKS * BLOCK_TOKENS
INDEX_BYTES = INDEX_BLOCKS * BLOCK_BYTES
# Stamps are integers, this many a tick of the caller's clock: as floats, a tick past 2**30
# (a billion picks: days of a busy gateway) had no room left for the depth offsets below it,
# every block of a prompt got one stamp, and trimming ate chains from their heads.
_UNIT = 10_000_000
_DEPTH = 1  # per block of depth: far below a tick
# The others' records between two of ours are stamped this far apart, after our last, so that
# the least recently sent goes first among them too (at 50 replicas a replica's own clock moves
# once in fifty records); at most `_LEARN_SPAN` of a tick past it, so 4,000 records learnt
# without a pick of our own in between fall back to one stamp (and insertion order), and a
# chain over 1,000 coarse blocks runs its tail past the step (both harmless). In the simulator
# (50 replicas, multi-tenant-chat, eight seeds) hit rate 0.59 -> 0.63, TTFT p90 1.41 -> 1.35 s.
_LEARN_STEP = _UNIT // 10_000
_LEARN_SPAN = _UNIT * 4 // 10
OUTBOX_RECORDS = 4096  # kept for the others between two drains: beyond, they are dropped
_FULL_SAMPLE = 1024  # entries a full node's estimate needs before it may only shrink the cap

# One answer a learning strategy read off a node, as its model takes it: (node, output tokens,
# prompt tokens to prefill, service seconds, seconds after the first token or None, whether
# the head is a clean reading). Only nodes in the reader's own table are learnt.
Reading = tuple[str, float, float, float, float | None, bool]


def prompt_blocks(prompt: bytes) -> tuple[int, ...]:
    """The prompt's coarse block hashes, for `RouteRequest.blocks`."""
    return tuple(block_hashes(prompt, every=INDEX_BLOCKS))


def body_blocks(body: Mapping[str, Any], size: int) -> tuple[int, ...]:
    """`prompt_blocks` of a request body of ``size`` bytes as sent. The prompt as the engine
    sees it is never longer than the JSON that carries it (the markup around each turn is
    longer than the newlines that replace it), so a body under one coarse block has none, and
    most short requests skip the walk."""
    if size < INDEX_BYTES:
        ids = first_ids(body)
        # Token ids are four bytes each as the engine's prompt, more than their JSON ("7,").
        if ids is None or len(ids) * BYTES_PER_TOKEN < INDEX_BYTES:
            return ()
    return prompt_blocks(prompt_bytes(body))


class _Node:
    __slots__ = ("boot", "cap", "seen", "sent")

    def __init__(self, cap: int) -> None:
        self.sent: dict[int, int] = {}  # block -> when it was last sent here (a stamp)
        self.cap = cap
        self.boot: str | None = None
        self.seen: object = None  # the snapshot the cap was last set from


class PrefixIndex:
    """Per node, a dict of the blocks sent there, so that recording a prompt is one dict
    update in C, and a node's match is a binary search down the prompt's chain in its dict."""

    def __init__(self, *, capacity: int = 8192, ttl: float = 1e18) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self._nodes: dict[str, _Node] = {}
        self._entries = 0  # blocks held over all nodes, kept as they change
        self._now = 0  # the caller's clock at its last record, as a stamp
        self._learnt = 0  # the stamp `learn` gave its last record: a step past the one before
        self._outbox: list[tuple[str, Sequence[int]]] | None = None  # None: not sharing
        self._readings: list[Reading] = []
        self._finished: dict[str, int] = {}  # per node, our tries ended since the last drain
        # Per node, starts the full outbox dropped: their ends are not sent either, or the
        # others took load off a node they never put on (-1,904 requests after 6,000 picks).
        self._dropped: dict[str, int] = {}
        self.on_reading: Callable[[Reading], None] | None = None  # the strategy's, if it learns

    def __len__(self) -> int:
        """Entries held, over all nodes: what the memory bound counts."""
        return self._entries

    def matches(
        self, blocks: Sequence[int], candidates: Sequence[NodeView], now: float
    ) -> dict[str, int]:
        """Per candidate that holds any of it, how many of ``blocks`` lead the prompt there.

        A chain is held from its start (what evicts a block evicts the deeper ones with it, as
        far as this index can tell), so the deepest held block is found by bisection: a few
        lookups a node, whatever the prompt's length. Most candidates hold the same depth (a
        shared system prompt, a conversation's history on its node), so the depth the last
        candidate held is tried first: past the first block, two lookups where it is the
        answer (one where it is the first block, or the whole prompt)."""
        if not blocks:
            return {}
        nodes = self._nodes
        # Half a tick: the depth offsets stay inside it.
        oldest = round((now - self.ttl) * _UNIT) - _UNIT // 2
        found: dict[str, int] = {}
        first = blocks[0]
        length = len(blocks)
        guess = 1
        for node in candidates:
            state = nodes.get(node.name)
            if state is None:
                continue
            snap = node.snapshot
            if snap is not None and state.boot is not None and snap.boot != state.boot:
                # Restarted, its cache gone: matched until the next record there noticed.
                state = self._state(node)
            get = state.sent.get
            sent = get(first)
            if sent is None or sent < oldest:
                continue
            low, high = 1, length  # blocks[:low] held; is blocks[:high]?
            if guess > 1:
                sent = get(blocks[guess - 1])
                if sent is None or sent < oldest:
                    high = guess - 1
                else:
                    low = guess
            if low == guess < length:  # held as deep as the guess: and one deeper?
                sent = get(blocks[guess])
                if sent is None or sent < oldest:
                    high = guess
                else:
                    low = guess + 1
            while low < high:
                mid = (low + high + 1) // 2
                sent = get(blocks[mid - 1])
                if sent is not None and sent >= oldest:
                    low = mid
                else:
                    high = mid - 1
            found[node.name] = guess = low
        return found

    def forget(self, name: str) -> None:
        """Node ``name``'s entries go (it left the table)."""
        state = self._nodes.pop(name, None)
        if state is not None:
            self._forget(state, 0)

    def placed(self, node: NodeView, blocks: Sequence[int]) -> None:
        """A request a wrapper placed itself (``[affinity]``'s ring), recorded at the caller's
        clock as last seen: its prefix is where it went, and the other replicas, told of its
        end by the balancer, must be told of its start too."""
        self._record(node, blocks, self._now)

    def record(self, node: NodeView, blocks: Sequence[int], now: float) -> None:
        """``blocks`` were sent to ``node``: it will hold them once it has prefilled. A request
        with none is recorded only for the other replicas, which count it as load."""
        self._record(node, blocks, round(now * _UNIT))

    def _record(self, node: NodeView, blocks: Sequence[int], stamp: int) -> None:
        self._now = stamp
        if stamp > self._learnt:  # a pick without blocks keeps the tick: no going back
            self._learnt = stamp
        if blocks:
            self._add(self._state(node), blocks, stamp)
        outbox = self._outbox
        if outbox is not None:
            if len(outbox) < OUTBOX_RECORDS:
                outbox.append((node.name, blocks))
            else:
                dropped = self._dropped
                dropped[node.name] = dropped.get(node.name, 0) + 1

    def tell(self, reading: Reading) -> None:
        """An answer the strategy learnt from, for the other replicas (while sharing)."""
        if self._outbox is not None and len(self._readings) < OUTBOX_RECORDS:
            self._readings.append(reading)

    def readings(self) -> list[Reading]:
        """The readings told since the last call, for the other replicas."""
        readings = self._readings
        if not readings:
            return []
        self._readings = []
        return readings

    def learn_readings(self, readings: Iterable[Reading], known: Container[str]) -> None:
        """The other replicas' readings, handed to the strategy's model: nodes in ``known``."""
        hook = self.on_reading
        if hook is None:
            return
        for reading in readings:
            if reading[0] in known:
                hook(reading)

    @property
    def sharing(self) -> bool:
        return self._outbox is not None

    def share(self) -> None:
        """Keep what is recorded from now on for `sent` (until drained): the replicas share."""
        if self._outbox is None:
            self._outbox = []

    def unshare(self) -> None:
        """Stop keeping records for others (sharing was turned off): the outboxes go, and the
        strategy goes back to its own estimate of the others' requests."""
        self._outbox = None
        self._readings = []
        self._finished = {}
        self._dropped = {}

    def finished(self, name: str) -> None:
        """A try on node ``name`` ended (whatever its outcome), for the other replicas: each
        record of a pick is load on its node until the matching end comes."""
        if self._outbox is not None:
            dropped = self._dropped.get(name)
            if dropped:  # the end of a start never sent (or of an earlier one: the same count)
                if dropped == 1:
                    del self._dropped[name]
                else:
                    self._dropped[name] = dropped - 1
                return
            ended = self._finished
            ended[name] = ended.get(name, 0) + 1

    def finishes(self) -> list[tuple[str, int]]:
        """Per node, the tries ended since the last call, for the other replicas."""
        ended = self._finished
        if not ended:
            return []
        self._finished = {}
        return list(ended.items())

    def learn_finishes(
        self, finishes: Iterable[tuple[str, int]], views: Mapping[str, NodeView]
    ) -> None:
        """Another replica's tries that ended: off their nodes' queues (`learn` put them on)."""
        for name, ended in finishes:
            view = views.get(name)
            if view is not None:
                view.others_since_snapshot -= ended

    def drain(
        self,
    ) -> tuple[list[tuple[str, Sequence[int]]], list[Reading], list[tuple[str, int]]]:
        """What goes to the other replicas in one exchange: `sent`, `readings`, `finishes`."""
        return self.sent(), self.readings(), self.finishes()

    def take(
        self,
        records: Iterable[tuple[str, Sequence[int]]],
        readings: Iterable[Reading],
        finishes: Iterable[tuple[str, int]],
        views: Mapping[str, NodeView],
    ) -> None:
        """One exchange of another replica's, as `drain` gave it there: `learn`,
        `learn_readings`, `learn_finishes`, for the nodes in ``views``."""
        self.learn(records, views)
        self.learn_readings(readings, views)
        self.learn_finishes(finishes, views)

    def sent(self) -> list[tuple[str, Sequence[int]]]:
        """The (node, blocks) recorded since the last call, for the other replicas."""
        outbox = self._outbox
        if not outbox:
            return []
        self._outbox = []
        return outbox

    def learn(
        self, records: Iterable[tuple[str, Sequence[int]]], views: Mapping[str, NodeView]
    ) -> None:
        """What another replica sent where: entries as if recorded now (in the order learnt),
        and a request more on the node's view (`NodeView.others_since_snapshot`: load its
        snapshot does not show yet). Only nodes in ``views`` (this replica's own): a peer's must
        not grow its memory. The node's entries are bounded by its snapshot as for our own
        records: a replica that seldom sends to a node itself otherwise held every record
        learnt for it, far more than the node's cache (in the simulator, 50 replicas on
        multi-tenant-chat, eight seeds: hit rate 0.49 -> 0.59 of one replica's 0.66)."""
        ceiling = self._now + _LEARN_SPAN
        for name, blocks in records:
            view = views.get(name)
            if view is None:
                continue
            view.others_since_snapshot += 1
            if not blocks:
                continue
            stamp = self._learnt + _LEARN_STEP
            self._learnt = stamp = stamp if stamp < ceiling else ceiling
            self._add(self._state(view), blocks, stamp)

    def _add(self, state: _Node, blocks: Sequence[int], now: int) -> None:
        # A chain's deeper blocks count as a hair older, so that trimming eats a chain from its
        # tail: the head alone is still a usable prefix, the tail alone matches nothing.
        sent = state.sent
        held = len(sent)
        sent.update(zip(blocks, count(now, -_DEPTH)))
        self._entries += len(sent) - held
        if len(sent) > state.cap + (state.cap >> 3):
            self._forget(state, state.cap)

    def _state(self, node: NodeView) -> _Node:
        state = self._nodes.get(node.name)
        if state is None:
            state = self._nodes[node.name] = _Node(self.capacity)
        snap = node.snapshot
        if snap is not None and snap is not state.seen:
            state.seen = snap
            if state.boot is not None and snap.boot != state.boot:
                self._forget(state, 0)  # restarted: its cache is gone
                state.cap = self.capacity  # and what it holds is to be learnt again
            state.boot = snap.boot
            engine = snap.engine
            kv = engine.kv_cache if engine is not None else None
            if engine is not None and engine.kv_tokens is not None:
                # The engine says what it holds: as many coarse blocks as fit, ours or the other
                # replicas' (with an index shared, an estimate from our share would drift).
                state.cap = min(self.capacity, max(1, engine.kv_tokens // INDEX_TOKENS))
                if len(state.sent) > state.cap:
                    self._forget(state, state.cap)
            elif kv is not None and state.sent:
                # Our blocks fill ``kv`` of the node as far as our traffic goes, so it holds
                # about len / kv of ours. Below full that is room to grow into; once full, the
                # engine evicts, and so do we, never growing on a full node.
                estimate = max(16, int(len(state.sent) / max(kv, 0.05)))
                # Not cut from a handful: a node already full when the index started (or was
                # emptied by a restart) had its cap locked at its first few entries (42; 8,192
                # at kv 0.5). A cap estimated before stands.
                if kv < 0.9:
                    cap = estimate
                elif state.cap >= self.capacity and len(state.sent) < _FULL_SAMPLE:
                    cap = state.cap
                else:
                    cap = min(state.cap, estimate)
                state.cap = min(self.capacity, cap)
                if len(state.sent) > state.cap:
                    self._forget(state, state.cap)
        return state

    def _forget(self, state: _Node, keep: int) -> None:
        """Down to ``keep`` blocks, the least recently sent first (sorted here, not kept in
        order per record: the index lets a node run an eighth over before it trims)."""
        sent = state.sent
        if len(sent) <= keep:
            return
        by_age = sorted(sent, key=sent.__getitem__)
        self._entries -= len(sent) - keep
        for block in by_age[: len(sent) - keep]:
            del sent[block]

    def keep_only(self, names: set[str]) -> None:
        """Forget every node not in ``names``: nodes that left (discovery, a reload) must not
        keep their entries, nor hand them to a newcomer reusing the name."""
        for name in [n for n in self._nodes if n not in names]:
            self.forget(name)
