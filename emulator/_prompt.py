"""The emulator's reading of a prompt: its size in tokens and its KV blocks, both by the
shared rule (`promptlb.shared.prompt_bytes`, `block_hashes`) that the simulator and the
middleware's index use too, so that what the middleware expects cached is what the node
caches."""

from __future__ import annotations

import json
import math

from promptlb.shared import block_hashes, prompt_bytes, prompt_tokens

__all__ = ["estimate_tokens", "prompt_blocks"]


def estimate_tokens(value: object) -> int:
    """About four characters a token, as tokenizers average on English text (embeddings)."""
    if isinstance(value, str):
        return max(1, math.ceil(len(value) / 4))
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # a pre-tokenised prompt
        return sum(estimate_tokens(v) for v in value)
    if isinstance(value, dict):
        return estimate_tokens(value.get("content", "")) + 4
    return 1


def prompt_blocks(prompt: object, *, chat: bool) -> tuple[int, list[int]]:
    """A chat's ``messages`` or a completion's ``prompt``: its tokens and its block hashes.
    Token ids are four bytes each under the rule (`prompt_bytes`); their JSON text took about
    seven, and pinned twice the blocks."""
    data = prompt_bytes({"messages" if chat else "prompt": prompt})
    if not data:
        data = json.dumps(prompt).encode()
    return prompt_tokens(data), block_hashes(data)
