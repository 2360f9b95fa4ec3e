"""The emulator's reading of a prompt: its size in tokens and its KV blocks, both by the
shared rule (`promptlb.shared.prompt_bytes`, `block_hashes`) that the simulator and the
middleware's index use too, so that what the middleware expects cached is what the node
caches."""

from __future__ import annotations

import json
import math

from promptlb.shared import block_hashes, prompt_bytes, prompt_tokens

__all__ = ["embedding_inputs", "estimate_tokens", "prompt_blocks"]


def estimate_tokens(value: str | list[int]) -> int:
    """One embeddings input's tokens: a token array's length, or about four characters a
    token for text, as tokenizers average on English."""
    if isinstance(value, str):
        return max(1, math.ceil(len(value) / 4))
    return len(value)


def embedding_inputs(raw: object) -> list[str | list[int]] | None:
    """An embeddings request's ``input`` as its inputs (a string, a token array, or a list of
    either, as the OpenAI API takes it), or None for any other shape: a node refuses what it
    cannot embed (a nested list's walk once overflowed the stack into a 500)."""
    if isinstance(raw, str):
        return [raw]
    if not isinstance(raw, list) or not raw:
        return None
    if all(_token(v) for v in raw):
        return [raw]
    if all(isinstance(v, str) or (isinstance(v, list) and v and all(map(_token, v))) for v in raw):
        return raw
    return None


def _token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_blocks(prompt: object, *, chat: bool) -> tuple[int, list[int]]:
    """A chat's ``messages`` or a completion's ``prompt``: its tokens and its block hashes.
    Token ids are four bytes each under the rule (`prompt_bytes`); their JSON text took about
    seven, and pinned twice the blocks."""
    data = prompt_bytes({"messages" if chat else "prompt": prompt})
    if not data:
        # No prompt the rule reads, so none the middleware indexes: its length counted from
        # its JSON, no block cached (cached as that JSON, the two disagreed on what is held).
        return prompt_tokens(json.dumps(prompt).encode()), []
    return prompt_tokens(data), block_hashes(data)
