"""An engine's KV cache, as vLLM's automatic prefix caching keeps it: blocks of 16 tokens named
by chained hashes (`promptlb.shared.block_hashes`), a capacity in blocks, the blocks of running
requests pinned, and the rest evicted least recently used first.

Pure and synchronous: the emulator runs it per node on real time and the simulator on virtual
time, so that both cache the same prompts the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from promptlb.shared import BLOCK_TOKENS

__all__ = ["KVCache", "Lease", "prefilled"]


def prefilled(elapsed: float, fixed: float, prefill: float) -> float:
    """How much of its uncached prompt a request had computed ``elapsed`` seconds into its
    head (``fixed`` seconds, then ``prefill`` seconds of prefill): 0..1, 1 once it is done.
    A request that leaves during its prefill caches only that much (`KVCache.finish`), as an
    engine keeps only the blocks it filled; it was credited with the whole prompt, so that a
    hedge's loser or a timed-out try handed its node a prefix for free."""
    if elapsed >= fixed + prefill - 1e-9:  # done (a rounding short of it in the simulator)
        return 1.0
    if prefill <= 0.0:
        return 0.0
    return max(0.0, (elapsed - fixed) / prefill)


@dataclass(slots=True)
class Lease:
    """A running request's hold on the cache: its prompt's blocks (pinned) and the blocks its
    output will fill (counted, never cached)."""

    blocks: Sequence[int]
    cached_tokens: int  # the prompt tokens found cached when it started
    scratch: int  # blocks held for the rest: the prompt's partial block and the output


class KVCache:
    """``capacity`` blocks. Cached blocks that no running request holds are evictable, least
    recently used first; held ones are not, and a node with every block held runs over its
    capacity rather than refuse (the usage it reports then reads 1.0)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a KV cache holds at least one block")
        self.capacity = capacity
        self._idle: OrderedDict[int, None] = OrderedDict()  # evictable, oldest first
        self._held: dict[int, int] = {}  # block -> running requests holding it
        self._scratch = 0
        self.query_tokens = 0  # prompt tokens looked up, as vLLM counts its prefix cache
        self.hit_tokens = 0

    @property
    def used(self) -> int:
        return len(self._idle) + len(self._held) + self._scratch

    @property
    def usage(self) -> float:
        """The blocks running requests hold over capacity, 0..1: vLLM's KV use gauge, which
        counts a cached block no request holds as free (it is evicted on demand). A node whose
        requests all finished reads 0 however full its prefix cache is."""
        return min(1.0, (len(self._held) + self._scratch) / self.capacity)

    @property
    def filled(self) -> float:
        """Cached or held blocks over capacity, 0..1: how full the prefix cache is, which no
        vLLM gauge shows (the benchmarks' per-node cache use over time)."""
        return min(1.0, self.used / self.capacity)

    def cached_prefix(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` lead the prompt cached (a chain: the first miss ends it)."""
        idle, held = self._idle, self._held
        n = 0
        for block in blocks:
            if block not in idle and block not in held:
                break
            n += 1
        return n

    def start(self, blocks: Sequence[int], prompt_tokens: int, output_tokens: int) -> Lease:
        """A request starts prefill: its cached prefix is counted as a hit, every block of its
        prompt is held (the new ones take room, evicting idle ones), and room is kept for the
        rest of its prompt and its output."""
        hit = self.cached_prefix(blocks)
        cached_tokens = min(prompt_tokens, hit * BLOCK_TOKENS)
        self.query_tokens += prompt_tokens
        self.hit_tokens += cached_tokens
        idle, held = self._idle, self._held
        for block in blocks:
            if block in idle:
                del idle[block]
                held[block] = 1
            else:
                held[block] = held.get(block, 0) + 1
        rest = prompt_tokens + output_tokens - len(blocks) * BLOCK_TOKENS
        scratch = max(0, -(-rest // BLOCK_TOKENS))
        self._scratch += scratch
        self._evict()
        return Lease(blocks, cached_tokens, scratch)

    def finish(self, lease: Lease, prefilled: float = 1.0) -> None:
        """The request is done: its prompt blocks stay cached (most recently used), its
        scratch is freed. Left during its prefill, only what was computed stays: the blocks
        it found cached and ``prefilled`` (0..1, `prefilled`) of the rest, in order; the
        blocks after them were never computed (held by another request, they stay its)."""
        idle, held = self._idle, self._held
        blocks = lease.blocks
        keep = len(blocks)
        if prefilled < 1.0:
            found = min(keep, lease.cached_tokens // BLOCK_TOKENS)
            keep = found + int(max(0.0, prefilled) * (keep - found))
        # Deepest first, so that the prompt's first block is the most recently used: eviction
        # then eats a chain from its tail, and what stays is still a usable prefix.
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            count = held.get(block, 0) - 1
            if count > 0:
                held[block] = count
                continue
            held.pop(block, None)
            if i < keep:
                idle[block] = None
                idle.move_to_end(block)
        self._scratch -= lease.scratch
        lease.scratch = 0
        lease.blocks = ()
        self._evict()

    def _evict(self) -> None:
        idle = self._idle
        over = self.used - self.capacity
        while over > 0 and idle:
            idle.popitem(last=False)
            over -= 1
