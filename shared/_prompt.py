"""What "the prompt" of an OpenAI request body is, for everything that reads one: the
middleware's affinity keys and classifier, and the emulator's prefix cache. One walker, so that
the emulator caches the same prefix the middleware routes by.

Chat ``messages`` give one turn per message that has text: its role and its text, the string
content or the non-empty text parts of list content (images and the like carry none). A
completion's ``prompt`` gives one turn per string, with no role: a batch's prompts run as
separate sequences. Token ids give nothing: there is no text to read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["prompt_prefix", "prompt_turns"]


def prompt_turns(body: Mapping[str, Any]) -> Iterator[tuple[str | None, list[str]]]:
    """The prompt's turns in order, as ``(role, text pieces)``: the role is ``""`` for a
    message whose role is not a string and None for a completion prompt. Lazy, so that a
    reader that has enough stops reading a long history."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                pieces = [content]
            elif isinstance(content, list):
                pieces = [
                    text
                    for part in content
                    if isinstance(part, dict) and isinstance(text := part.get("text"), str) and text
                ]
            else:
                continue
            role = message.get("role")
            yield (role if isinstance(role, str) else ""), pieces
        return
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        yield None, [prompt]
    elif isinstance(prompt, list):
        for one in prompt:
            if isinstance(one, str):
                yield None, [one]


def prompt_prefix(body: Mapping[str, Any], limit: int) -> str:
    """The first ``limit`` characters of the prompt as an engine's chat template lays it out
    (role, newline, content, newline, message by message), or all of a shorter one. A batch's
    first prompt stands for it: that is the sequence whose prefix an engine caches first."""
    parts: list[str] = []
    size = 0
    for role, pieces in prompt_turns(body):
        if role is None:
            parts.append(pieces[0])
            break
        # The role is part of what a prefix cache sees (the chat template renders it).
        piece = f"{role}\n{''.join(pieces)}\n"
        parts.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return "".join(parts)[:limit]
