"""How a prompt becomes tokens and KV-cache blocks, one rule for everything that models a cache:
the emulator's engine, the simulator, and the middleware's index of what it sent where.

The emulator has no tokenizer, so the rule is a stand-in that keeps what matters for caching:
a token is four bytes of the prompt as the engine sees it (the chat template's rendering, not
the request's JSON: the same conversation serialised with other spacing caches alike), a block
is 16 tokens as in vLLM, and a block is identified by a hash chained over every block before
it, so that a block hash names the whole prefix up to it. Only full blocks are cached.

The chain is CRC-32 (``zlib.crc32`` continues a checksum from the previous one, in C), so a
prefix's hashes cost one C call a block: an 8,000-token prompt is hashed in tens of
microseconds. 32 bits are enough for an emulated cache and an approximate index; a collision
costs one wrong guess, never a wrong answer.
"""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Mapping
from typing import Any

from ._prompt import prompt_turns

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_TOKENS",
    "BYTES_PER_TOKEN",
    "block_hashes",
    "prompt_bytes",
    "prompt_tokens",
]

BYTES_PER_TOKEN = 4
assert array("I").itemsize == BYTES_PER_TOKEN  # token ids are packed as C unsigned ints
BLOCK_TOKENS = 16
BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN


def prompt_bytes(body: Mapping[str, Any]) -> bytes:
    """The prompt as the engine sees it: each chat turn as ``role\\ncontent\\n`` (the text
    parts of list content joined), or a completion's first prompt; a prompt of token ids as
    four bytes each (the rule's token; equal ids alike), a batch of them by its first. Empty
    for anything else."""
    parts: list[str] = []
    for role, pieces in prompt_turns(body):
        if role is None:
            parts.append(pieces[0])
            break
        parts.append(f"{role}\n{''.join(pieces)}\n")
    if not parts:
        ids = first_ids(body)
        if ids:
            return _token_bytes(ids)
    return "".join(parts).encode("utf-8", "surrogatepass")


def first_ids(body: Mapping[str, Any]) -> list[Any] | None:
    """A completion's prompt of token ids, or a batch's first (which stands for the batch, as
    a batch's first text does; read whole, a batch was no prompt at all to the middleware and
    its JSON text to the emulator)."""
    prompt = body.get("prompt")
    if type(prompt) is not list or not prompt:
        return None
    ids = prompt[0] if type(prompt[0]) is list else prompt
    return ids or None  # (a batch whose first is empty: none, as an empty prompt)


def _token_bytes(ids: list[Any]) -> bytes:
    """Token ids, four little-endian bytes each (ids past 32 bits by their low 32); empty
    when they are not all integers. The middleware indexed nothing of such a prompt while the
    emulator cached it, so its answers taught the whole prompt as prefill."""
    try:
        packed = array("I", ids)  # in C: its own check that every id is an integer
    except OverflowError:  # a negative id, or one past 32 bits
        if not all(isinstance(v, int) for v in ids):
            return b""
        packed = array("I", [v & 0xFFFFFFFF for v in ids])
    except TypeError:
        return b""
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def prompt_tokens(data: bytes) -> int:
    """The prompt's length in tokens under the rule: one per four bytes, at least one."""
    return max(1, -(-len(data) // BYTES_PER_TOKEN))


def block_hashes(data: bytes, every: int = 1, limit: int | None = None) -> list[int]:
    """The chained hashes of ``data``'s full blocks, one per ``every`` blocks (a coarser index
    hashes fewer: the hash at block ``k * every`` still names the whole prefix up to it), at
    most ``limit`` of them."""
    step = BLOCK_BYTES * every
    count = len(data) // step
    if limit is not None:
        count = min(count, limit)
    view = memoryview(data)
    out: list[int] = []
    append = out.append
    h = 0
    crc = zlib.crc32
    for start in range(0, count * step, step):
        h = crc(view[start : start + step], h)
        append(h)
    return out
