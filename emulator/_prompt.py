"""The emulator's reading of a prompt: its size in tokens and its KV blocks, both by the
shared rule (`promptlb.shared.prompt_bytes`, `block_hashes`) that the simulator and the
middleware's index use too, so that what the middleware expects cached is what the node
caches."""

from __future__ import annotations

import json
import math

from promptlb.shared import block_hashes, prompt_bytes, prompt_tokens

__all__ = ["embedding_inputs", "estimate_tokens", "generation_prompt", "prompt_blocks"]


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


def generation_prompt(prompt: object, *, chat: bool) -> tuple[list[int], list[int]] | str:
    """A chat's ``messages`` or a completion's ``prompt`` as ``(tokens of each prompt, block
    hashes)``, or why a server refuses it. A completion may be a batch (a list of strings, or
    of token-id lists): each prompt is answered and paid for, and the first's blocks stand for
    the batch's cache (as `prompt_blocks`). Before, only a missing field was refused: a
    ``messages`` of ``"hello"`` or ``[]``, a ``prompt`` of ``[[]]`` were served as a token of
    their JSON, and a batch of 50 prompts as its first alone (one choice, one prefill)."""
    if chat:
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(m, dict) for m in prompt)
        ):
            return "`messages` must be a non-empty list of message objects"
        return _one(prompt, chat=True)
    if (isinstance(prompt, str) and prompt) or (
        isinstance(prompt, list) and prompt and all(_token_id(v) for v in prompt)
    ):
        return _one(prompt, chat=False)
    if (
        isinstance(prompt, list)
        and prompt
        and (
            all(isinstance(v, str) and v for v in prompt)
            or all(isinstance(v, list) and v and all(map(_token_id, v)) for v in prompt)
        )
    ):
        counts = [prompt_tokens(prompt_bytes({"prompt": one})) for one in prompt]
        return counts, prompt_blocks(prompt, chat=False)[1]
    return (
        "`prompt` must be a non-empty string, a list of token ids (0..2^32-1), or a non-empty"
        " list of either, none empty"
    )


def _token_id(value: object) -> bool:
    """A token id a vocabulary could hold (vLLM refuses ids past its vocabulary's size)."""
    return _token(value) and 0 <= value < 1 << 32  # type: ignore[operator]


def _one(prompt: object, *, chat: bool) -> tuple[list[int], list[int]]:
    tokens, blocks = prompt_blocks(prompt, chat=chat)
    return [tokens], blocks
