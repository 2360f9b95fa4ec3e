"""What the emulator answers: OpenAI-shaped completion bodies and SSE events with filler text,
and deterministic embeddings."""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Reply", "vector", "words"]

_TEXT = (
    "the quick brown fox jumps over a lazy dog while small models answer fast and big models "
    "think long about every prompt they are given"
)
_WORDS = tuple(_TEXT.split(" "))


def words(start: int, count: int) -> str:
    """``count`` words of filler text from the ``start``-th on: a stream's pieces add up to
    the whole body's text."""
    return "".join(_WORDS[(start + i) % len(_WORDS)] + " " for i in range(count))


def vector(value: object, dim: int) -> list[float]:
    """A deterministic unit vector per input, so equal inputs embed equally."""
    digest = b""
    seed = json.dumps(value, sort_keys=True).encode()
    while len(digest) < dim * 4:
        seed = hashlib.sha256(seed).digest()
        digest += seed
    ints = struct.unpack(f"<{dim}I", digest[: dim * 4])
    vec = [i / 2**31 - 1.0 for i in ints]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


@dataclass(slots=True)
class Reply:
    """One generation's answer: the whole body, or its stream's SSE events."""

    chat: bool
    model: str
    n_in: int
    n_out: int
    body: dict[str, Any]
    # "length" where max_tokens cut the answer; "stop" where it ended by itself (its length
    # drawn, no max_tokens asked): a client that reads "length" as truncated was misled.
    finish: str = "length"
    n: int = 1  # choices, each n_out tokens long
    id: str = ""  # vLLM's shape: chatcmpl-... for a chat, cmpl-... for a completion
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]

    def _usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.n_in,
            "completion_tokens": self.n * self.n_out,
            "total_tokens": self.n_in + self.n * self.n_out,
        }

    def whole(self) -> dict[str, Any]:
        text = words(0, self.n_out)
        choices: list[dict[str, Any]] = []
        for i in range(self.n):
            if self.chat:
                message = {"role": "assistant", "content": text}
                choices.append({"index": i, "finish_reason": self.finish, "message": message})
            else:
                choices.append({"index": i, "finish_reason": self.finish, "text": text})
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
        }

    def event(self, content: str | dict[str, str], finish: str | None, index: int = 0) -> bytes:
        if self.chat:
            delta = (
                content if isinstance(content, dict) else ({"content": content} if content else {})
            )
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": content, "finish_reason": finish}
            kind = "text_completion"
        chunk = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def usage_event(self) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self._usage(),
        }
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
