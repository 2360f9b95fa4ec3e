"""The emulator's KV cache: blocks named by chained hashes, the running requests' blocks held,
the rest evicted least recently used first, hits counted in prompt tokens as vLLM counts them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from promptlb.emulator._kv import KVCache, prefilled
from promptlb.shared import BLOCK_BYTES, BLOCK_TOKENS, block_hashes


def blocks(text: str) -> list[int]:
    return block_hashes(text.encode())


SYSTEM = "s" * (BLOCK_BYTES * 4)  # four full blocks


def test_a_shared_prefix_is_found_and_counted_in_tokens() -> None:
    kv = KVCache(100)
    first = blocks(SYSTEM + "a" * BLOCK_BYTES * 2)
    lease = kv.start(first, prompt_tokens=96, output_tokens=10)
    assert lease.cached_tokens == 0
    kv.finish(lease)
    second = blocks(SYSTEM + "b" * BLOCK_BYTES * 2)  # the same four blocks, then others
    assert kv.cached_prefix(second) == 4
    lease = kv.start(second, prompt_tokens=96, output_tokens=10)
    assert lease.cached_tokens == 4 * BLOCK_TOKENS
    assert (kv.query_tokens, kv.hit_tokens) == (192, 64)


def test_a_request_left_during_its_prefill_caches_only_what_it_computed() -> None:
    """It cached its whole prompt: a hedge's loser or a timed-out try, gone a moment into a
    long prefill, handed its node the prefix for free."""
    kv = KVCache(100)
    kv.finish(kv.start(blocks(SYSTEM), 64, 0))  # four blocks cached
    prompt = blocks(SYSTEM + "q" * BLOCK_BYTES * 8)  # four found, eight to compute
    left = kv.start(prompt, 192, 0)
    kv.finish(left, prefilled(elapsed=0.5, fixed=0.2, prefill=0.6))  # half computed
    assert kv.cached_prefix(prompt) == 4 + 4  # what was found, and the half computed
    assert kv.used == 8  # the rest freed, not kept as cache
    # Blocks another request holds stay its, and cached once it is done.
    twin, left = kv.start(prompt, 192, 0), kv.start(prompt, 192, 0)
    kv.finish(left, 0.0)
    assert kv.cached_prefix(prompt) == 12
    kv.finish(twin)
    assert kv.cached_prefix(prompt) == 12 and kv.used == 12
    assert prefilled(0.05, 0.1, 0.8) == 0.0 and prefilled(0.9, 0.1, 0.8) == 1.0
    assert prefilled(0.1, 0.1, 0.0) == 1.0  # nothing to prefill: done once the fixed part is


def test_a_chain_is_cut_at_its_first_difference() -> None:
    kv = KVCache(100)
    kv.finish(kv.start(blocks("x" * BLOCK_BYTES * 3), 48, 0))
    # the same last two blocks after another first one: chained hashes differ throughout
    assert kv.cached_prefix(blocks("y" * BLOCK_BYTES + "x" * BLOCK_BYTES * 2)) == 0


def test_held_blocks_are_never_evicted_and_idle_ones_go_least_recent_first() -> None:
    kv = KVCache(8)
    running = kv.start(blocks("r" * BLOCK_BYTES * 4), 64, 0)
    old = blocks("o" * BLOCK_BYTES * 2)
    kv.finish(kv.start(old, 32, 0))
    new = blocks("n" * BLOCK_BYTES * 2)
    kv.finish(kv.start(new, 32, 0))
    assert kv.used == 8
    kv.finish(kv.start(blocks("z" * BLOCK_BYTES * 2), 32, 0))  # two more: the oldest idle go
    assert kv.cached_prefix(old) == 0
    assert kv.cached_prefix(new) == 2
    assert kv.cached_prefix(running.blocks) == 4  # held: untouched
    assert kv.used <= kv.capacity


def test_eviction_eats_a_chain_from_its_tail() -> None:
    kv = KVCache(4)
    chain = blocks("c" * BLOCK_BYTES * 4)
    kv.finish(kv.start(chain, 64, 0))
    kv.finish(kv.start(blocks("d" * BLOCK_BYTES), 16, 0))  # one block must go
    assert kv.cached_prefix(chain) == 3  # its last block, not its first


def test_output_and_a_partial_block_take_room_but_are_not_cached() -> None:
    kv = KVCache(100)
    lease = kv.start(blocks("p" * (BLOCK_BYTES * 2 + 10)), 35, output_tokens=40)
    assert lease.scratch == 3  # the prompt's last 3 tokens and 40 of output: 43 -> 3 blocks
    assert kv.used == 2 + lease.scratch
    assert kv.usage == kv.filled == pytest.approx(0.05)
    kv.finish(lease)
    assert kv.used == 2
    assert kv.filled == pytest.approx(0.02)


def test_usage_reads_as_vllm_s_gauge_cached_blocks_no_request_holds_are_free() -> None:
    kv = KVCache(10)
    done = kv.start(blocks("d" * BLOCK_BYTES * 4), 64, 0)
    kv.finish(done)  # four blocks cached, none held
    assert kv.usage == 0.0 and kv.filled == pytest.approx(0.4)
    running = kv.start(blocks("d" * BLOCK_BYTES * 4 + "e" * BLOCK_BYTES * 2), 96, 0)
    assert running.cached_tokens == 64  # the cached four are held again, with two new ones
    assert kv.usage == kv.filled == pytest.approx(0.6)
    kv.finish(running)
    assert kv.usage == 0.0 and kv.filled == pytest.approx(0.6)


def test_a_cache_with_every_block_held_runs_over_and_reads_full() -> None:
    kv = KVCache(2)
    lease = kv.start(blocks("h" * BLOCK_BYTES * 3), 48, 0)
    assert kv.used == 3 and kv.usage == kv.filled == 1.0
    kv.finish(lease)
    assert kv.used == 2
    assert (kv.usage, kv.filled) == (0.0, 1.0)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), max_size=40))
def test_used_never_exceeds_capacity_once_nothing_is_held(ops: list[tuple[int, int]]) -> None:
    kv = KVCache(10)
    for prefix, length in ops:
        kv.finish(kv.start(blocks(str(prefix) * BLOCK_BYTES * length), length * 16, 3))
        assert kv.used <= kv.capacity
    assert kv.hit_tokens <= kv.query_tokens
