"""The emulator's reading of a prompt: its size in tokens, and the head its prefix cache keys
on. The head is `promptlb.shared.prompt_prefix`, the middleware's own reading, so that a
request the middleware routes by a prefix finds that prefix cached on the node it chose."""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict

from promptlb.shared import prompt_prefix

from ._metrics import Stats

__all__ = ["PrefixCache", "estimate_tokens", "prompt_head"]


def estimate_tokens(value: object) -> int:
    """About four characters a token, as tokenizers average on English text."""
    if isinstance(value, str):
        return max(1, math.ceil(len(value) / 4))
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # a pre-tokenised prompt
        return sum(estimate_tokens(v) for v in value)
    if isinstance(value, dict):
        return estimate_tokens(value.get("content", "")) + 4
    return 1


def prompt_head(prompt: object, *, chat: bool, limit: int) -> str:
    """The first ``limit`` characters of a chat's ``messages`` or a completion's ``prompt`` as
    an engine's chat template would lay them out; all of a shorter one."""
    head = prompt_prefix({"messages" if chat else "prompt": prompt}, limit)
    # Token ids have no text: their JSON text stands for them, equal ids alike.
    return head or json.dumps(prompt)[:limit]


class PrefixCache:
    """The node's KV prefix cache: hashes of recent prompts' heads, least recently used first,
    counted as vLLM counts its prefix cache."""

    __slots__ = ("_entries", "_limit", "_stats")

    def __init__(self, limit: int, stats: Stats) -> None:
        self._limit = limit
        self._stats = stats
        self._entries: OrderedDict[bytes, None] = OrderedDict()

    @staticmethod
    def key(head: str) -> bytes:
        return hashlib.blake2b(head.encode(), digest_size=16).digest()

    def lookup(self, key: bytes, n_in: int, chars: int) -> bool:
        """Whether the prefix is cached; a hit covers the head's tokens, at most the prompt's."""
        stats = self._stats
        stats.prefix_queries += 1
        stats.prefix_query_tokens += n_in
        entries = self._entries
        if key not in entries:
            return False
        entries.move_to_end(key)
        stats.prefix_hits += 1
        stats.prefix_hit_tokens += min(n_in, math.ceil(chars / 4))
        return True

    def store(self, key: bytes) -> None:
        if self._limit == 0:
            return
        entries = self._entries
        entries[key] = None
        entries.move_to_end(key)
        while len(entries) > self._limit:
            entries.popitem(last=False)
