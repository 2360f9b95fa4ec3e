"""What "the prompt" of an OpenAI request body is, for everything that reads one: the
middleware's affinity keys and classifier, and the emulator's prefix cache. One walker, so that
the emulator caches the same prefix the middleware routes by.

Chat ``messages`` give one turn per message that has content or tool calls: its role and its
pieces, the string content or the parts of list content (text as it is; an image, audio or file
part as a stand-in naming its type and a digest of its payload, so that two prompts that differ
only in an image are two prefixes), then each tool call as ``name(arguments)`` (an agent's
histories that differ only in the calls made were one prefix). A completion's ``prompt`` gives
one turn per string, with no role: a batch's prompts run as separate sequences. Token ids give
nothing: there is no text to read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["prompt_prefix", "prompt_turns"]

_EDGE = 4096  # characters of each end of a non-text part's payload that its stand-in hashes


def prompt_turns(body: Mapping[str, Any]) -> Iterator[tuple[str | None, list[str]]]:
    """The prompt's turns in order, as ``(role, text pieces)``: the role is ``""`` for a
    message whose role is not a string and None for a completion prompt. Lazy, so that a
    reader that has enough stops reading a long history. ``messages`` when it is a list, else
    ``prompt`` (a reader that knows the endpoint passes the body without the other field)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            calls = message.get("tool_calls")
            if isinstance(content, str):
                pieces = [content]
            elif isinstance(content, list):
                pieces = [piece for part in content if (piece := _part(part))]
            elif isinstance(calls, list) and calls:
                pieces = []
            else:
                continue
            if isinstance(calls, list):
                pieces.extend(piece for call in calls if (piece := _call(call)))
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


def _part(part: object) -> str:
    """A content part's piece: its text, or a stand-in for a part that carries none."""
    if not isinstance(part, dict):
        return ""
    text = part.get("text")
    if isinstance(text, str):
        return text
    kind = part.get("type")
    if not isinstance(kind, str) or kind == "text":
        return ""
    payload = part.get(kind)
    digest = hashlib.blake2b(digest_size=8)
    # Its strings (an image's URL or base64 data, a file's id), each by its length and edges:
    # the whole of a 4 MB image, serialised and hashed, held the event loop for 40 ms on
    # every walk. Two payloads alike in length and both 4 KB edges are one prefix: rare.
    values = payload.items() if isinstance(payload, dict) else [("", payload)]
    told = False
    for key, value in sorted(values, key=lambda item: str(item[0])):
        if isinstance(value, str) and value:
            edges = value if len(value) <= 2 * _EDGE else value[:_EDGE] + value[-_EDGE:]
            digest.update(f"{key}={len(value)}:{edges};".encode("utf-8", "replace"))
            told = True
    if not told:
        # No text to tell it by: its kind alone, shorter than its JSON (``{"type":...}``).
        # With a digest of nothing it was longer, and a body under one coarse block held a
        # block the middleware's shortcut (`body_blocks`) never looked for.
        return f"<{kind[:32]}>"
    return f"<{kind[:32]}:{digest.hexdigest()}>"


def _call(call: object) -> str:
    """A tool call's piece, ``name(arguments)``, as a chat template renders it."""
    if not isinstance(call, dict):
        return ""
    function = call.get("function")
    if not isinstance(function, dict):
        return ""
    name, arguments = function.get("name"), function.get("arguments")
    name = name if isinstance(name, str) else ""
    arguments = arguments if isinstance(arguments, str) else ""
    return f"{name}({arguments})" if name or arguments else ""
