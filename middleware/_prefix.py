"""An approximate index of the prompt prefixes this middleware sent to each node, so that a
strategy can tell how much of a prompt a node most likely holds in its KV cache.

The prompt is hashed by the engine's own rule (`promptlb.shared._kv`: the chat template's
rendering, chained block hashes), coarsened to one hash per ``INDEX_BLOCKS`` engine blocks (128
tokens): the hash at a coarse block names the whole prefix up to it, so a node's match is the
deepest coarse block it was sent, and an 8,000-token prompt costs 62 hashes, not 500.

What it holds, and how it forgets (the guards that keep it close to the node's real cache):
- per node, the coarse blocks sent there, least recently used first; a node holds at most
  ``capacity`` of them (the configured bound), and, once its snapshots show its KV use, about
  as many as fit: our blocks over its KV use is its capacity as far as our traffic goes, so
  when its cache is full, ours is trimmed to what it can hold;
- entries not used for ``ttl`` seconds do not match (an engine's LRU has let them go);
- a node that restarts (a new ``boot`` in its snapshot) starts empty.
Memory: one dict entry per coarse block and node, ~200 bytes: at the default bound (8,192 per
node) 1.6 MB a node, a bound the config can lower for 1,000 nodes.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence

from promptlb.shared import BLOCK_TOKENS, block_hashes

from ._view import NodeView

__all__ = ["INDEX_BLOCKS", "INDEX_TOKENS", "PrefixIndex", "prompt_blocks"]

INDEX_BLOCKS = 8  # engine blocks per coarse block
INDEX_TOKENS = INDEX_BLOCKS * BLOCK_TOKENS


def prompt_blocks(prompt: bytes) -> tuple[int, ...]:
    """The prompt's coarse block hashes, for `RouteRequest.blocks`."""
    return tuple(block_hashes(prompt, every=INDEX_BLOCKS))


def first_choice(first_block: int, candidates: Sequence[NodeView]) -> NodeView:
    """Rendezvous hashing of a prefix's first block over the candidates: every replica, with no
    state shared, picks the same node for a prefix nobody holds yet, and a node leaving moves
    only its own prefixes."""
    best, chosen = -1, candidates[0]
    for node in candidates:
        score = zlib.crc32(node.name.encode(), first_block)
        if score > best:
            best, chosen = score, node
    return chosen


class _Node:
    __slots__ = ("boot", "cap", "lru", "seen")

    def __init__(self, cap: int) -> None:
        self.lru: OrderedDict[int, float] = OrderedDict()  # block -> last sent, oldest first
        self.cap = cap
        self.boot: str | None = None
        self.seen: object = None  # the snapshot the cap was last set from


class PrefixIndex:
    def __init__(self, *, capacity: int = 8192, ttl: float = 600.0) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self._holders: dict[int, dict[str, float]] = {}  # block -> node -> last sent
        self._nodes: dict[str, _Node] = {}

    def __len__(self) -> int:
        """Entries held, over all nodes: what the memory bound counts."""
        return sum(len(n.lru) for n in self._nodes.values())

    def matches(
        self, blocks: Sequence[int], candidates: Sequence[NodeView], now: float
    ) -> dict[str, int]:
        """Per candidate that holds any of it, how many of ``blocks`` lead the prompt there.
        Walks from the deepest block up, so a prefix every node holds costs one visit per node,
        not one per node and block."""
        if not blocks:
            return {}
        wanted = {c.name for c in candidates}
        found: dict[str, int] = {}
        holders = self._holders
        oldest = now - self.ttl
        for depth in range(len(blocks), 0, -1):
            held = holders.get(blocks[depth - 1])
            if not held:
                continue
            for name, sent in held.items():
                if sent >= oldest and name in wanted and name not in found:
                    found[name] = depth
            if len(found) == len(wanted):
                break
        return found

    def record(self, node: NodeView, blocks: Sequence[int], now: float) -> None:
        """``blocks`` were sent to ``node``: it will hold them once it has prefilled."""
        if not blocks:
            return
        state = self._state(node)
        lru, holders, name = state.lru, self._holders, node.name
        for block in blocks:
            lru[block] = now
            lru.move_to_end(block)
            held = holders.get(block)
            if held is None:
                holders[block] = {name: now}
            else:
                held[name] = now
        self._trim(state, name)

    def _state(self, node: NodeView) -> _Node:
        state = self._nodes.get(node.name)
        if state is None:
            state = self._nodes[node.name] = _Node(self.capacity)
        snap = node.snapshot
        if snap is not None and snap is not state.seen:
            state.seen = snap
            if state.boot is not None and snap.boot != state.boot:
                self._forget(state, node.name, 0)  # restarted: its cache is gone
            state.boot = snap.boot
            kv = snap.engine.kv_cache if snap.engine is not None else None
            if kv is not None and state.lru:
                # Our blocks fill ``kv`` of the node as far as our traffic goes, so it holds
                # about len / kv of ours. Below full that is room to grow into; once full, the
                # engine evicts, and so do we, never growing on a full node.
                estimate = max(16, int(len(state.lru) / max(kv, 0.05)))
                cap = estimate if kv < 0.9 else min(state.cap, estimate)
                state.cap = min(self.capacity, cap)
        return state

    def _trim(self, state: _Node, name: str) -> None:
        self._forget(state, name, state.cap)

    def _forget(self, state: _Node, name: str, keep: int) -> None:
        lru, holders = state.lru, self._holders
        while len(lru) > keep:
            block, _ = lru.popitem(last=False)
            held = holders.get(block)
            if held is not None:
                held.pop(name, None)
                if not held:
                    del holders[block]

    def forget_node(self, name: str) -> None:
        state = self._nodes.pop(name, None)
        if state is not None:
            self._forget(state, name, 0)
