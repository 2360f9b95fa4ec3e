"""Streams and whole answers: an SSE stream assembled into the non-stream JSON answer the cache
stores, and a stored answer replayed as SSE events the openai client parses."""

from __future__ import annotations

import json
import mmap
from collections.abc import Mapping
from typing import Any

from ._cache import CacheEntry

__all__ = [
    "CUT",
    "StreamAssembler",
    "marks_error",
    "replay_sse",
    "replayable",
    "wants_usage",
]

_PLAIN = frozenset({"role", "content"})  # what a delta may carry for the answer to be kept
# The finish reasons of an answer the engine cut (vLLM's and SGLang's "abort", an "error"):
# half an answer, no answer to keep. A list of the cuts, not of the ends: engines name their
# ends their own ways (TGI's "eos_token" and "stop_sequence").
CUT = frozenset({"abort", "error", "cancelled", "canceled"})


def _more_than_text(part: dict[str, Any]) -> bool:
    """Whether a message or delta carries something besides its text. Empty values are
    nothing: vLLM's every message has ``"tool_calls": []``, OpenAI's ``"annotations": []``,
    and no answer of theirs could be replayed to a streaming client."""
    return any(
        k not in _PLAIN and v is not None and not (isinstance(v, list | dict | str) and not v)
        for k, v in part.items()
    )


_FIRST_MAP = 64 * 1024  # a text's first memory map: address space only until written
# Choices a kept stream may have (OpenAI's most for ``n``). Each costs a page of its map and
# a dict whatever its text, which the bound on text bytes does not see: 20,000 one-byte
# choices were 20 KB of text and 86 MB of memory.
MAX_CHOICES = 128
_UTF8 = "surrogatepass"  # JSON may carry a lone surrogate: kept as it came, not an error


class _Text:
    """One choice's text so far, as UTF-8 in an anonymous memory map of its own, doubled when
    full. Not a list of the pieces as they came: a piece per token costs an object of about
    50 bytes for a few bytes of text, and whatever their size the allocator kept the memory
    once the streams ended (RSS 52 -> 914 MB over a soak of 1,000 ten-minute streams; 300
    streams that each let go of 200 KB of text left it 60 MB bigger, 12 MB with maps). A map
    goes back to the system as soon as it is closed or dropped, and only pages written count."""

    __slots__ = ("_map", "size")

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self.size = 0  # bytes of UTF-8 written

    def add(self, piece: str) -> int:
        """Appends ``piece``; returns the bytes it took."""
        data = piece.encode("utf-8", _UTF8)
        end = self.size + len(data)
        mapped = self._map
        if mapped is None or end > len(mapped):
            mapped = self._grow(end)
        mapped[self.size : end] = data
        self.size = end
        return len(data)

    def _grow(self, need: int) -> mmap.mmap:
        capacity = max(_FIRST_MAP, 1 << (need - 1).bit_length())
        grown = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE)
        if self._map is not None:
            grown[: self.size] = self._map[: self.size]
            self._map.close()
        self._map = grown
        return grown

    def text(self) -> str:
        if self._map is None:
            return ""
        return self._map[: self.size].decode("utf-8", _UTF8)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self.size = 0


def marks_error(obj: dict[str, Any]) -> bool:
    """Whether a node's JSON object says it is an error: OpenAI's and TEI's ``"error"`` (not a
    null one, which the Responses API's objects carry) or vLLM's older ``{"object": "error"}``."""
    return obj.get("error") is not None or obj.get("object") == "error"


class StreamAssembler:
    """Fed the SSE bytes of a stream as they pass; gives the whole answer (non-stream JSON)
    once the stream ended well, or ``None``.

    ``max_bytes`` bounds the answer it gives, not the stream that carried it: a stream sent
    token by token spends some 200 bytes of event on each few bytes of text, so a bound on
    the stream kept no answer of more than about 5,000 tokens under the default 1 MB. While
    it assembles, the text kept and the line not yet ended are each held to the bound."""

    __slots__ = (
        "_buffer",
        "_chat",
        "_choices",
        "_done",
        "_failed",
        "_head",
        "_size",
        "_usage",
        "max_bytes",
    )

    def __init__(self, chat: bool, *, max_bytes: int = 1024 * 1024) -> None:
        self._chat = chat
        self.max_bytes = max_bytes
        self._buffer = b""
        self._size = 0
        self._head: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._usage: Any = None
        self._done = False
        self._failed = False

    def feed(self, chunk: bytes) -> None:
        if self._failed or self._done:
            return
        *lines, rest = (self._buffer + chunk.replace(b"\r\n", b"\n")).split(b"\n")
        if len(rest) > self.max_bytes:  # one event longer than any answer kept
            self._give_up()
            return
        self._buffer = rest
        for line in lines:
            if line.startswith(b"data:"):
                try:
                    self._event(line[5:].strip())
                except (TypeError, AttributeError, ValueError, OSError):
                    # An event of a shape we do not know, or a memory map refused (past the
                    # system's count of maps): never break the client's stream for the
                    # cache's sake; just do not keep this one.
                    self._give_up()
                    return
                if self._failed:  # given up on this event: the chunk's rest is not assembled
                    return
                if self._size > self.max_bytes:
                    self._give_up()
                    return

    def _give_up(self) -> None:
        """Not to be stored: let go of what was assembled at once. A thousand long streams each
        holding their text until they end kept the gateway a gigabyte bigger after a soak."""
        self._failed = True
        self._buffer = b""
        for choice in self._choices.values():
            choice["text"].close()
        self._choices = {}
        self._head = {}
        self._usage = None

    def _event(self, data: bytes) -> None:
        if data == b"[DONE]":
            self._done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self._give_up()
            return
        if not isinstance(event, dict) or marks_error(event):
            self._give_up()
            return
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in event and key not in self._head:
                self._head[key] = event[key]
        if event.get("usage"):
            self._usage = event["usage"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            into = self._choices.get(index)
            if into is None:
                if len(self._choices) >= MAX_CHOICES:
                    self._give_up()
                    return
                into = self._choices[index] = {"text": _Text(), "role": "assistant"}
            if choice.get("logprobs") is not None:
                self._give_up()  # not kept: the whole answer would lose them
                return
            if self._chat:
                delta = choice.get("delta") or {}
                if _more_than_text(delta):
                    self._give_up()  # tool calls, reasoning, refusals: not kept
                    return
                if delta.get("role"):
                    into["role"] = delta["role"]
                if delta.get("content"):
                    self._size += into["text"].add(delta["content"])
            elif choice.get("text"):
                self._size += into["text"].add(choice["text"])
            reason = choice.get("finish_reason")
            if reason:
                if reason in CUT:
                    # Ended by the engine, not by the answer (vLLM's "abort", an "error"):
                    # half an answer, then [DONE], was kept and replayed to every twin.
                    self._give_up()
                    return
                into["finish_reason"] = reason

    @property
    def has_usage(self) -> bool:
        """Whether the stream carried its usage (``stream_options.include_usage``)."""
        return self._usage is not None

    def result(self) -> bytes | None:
        if self._failed or not self._done or not self._choices:
            return None
        try:
            whole = self._whole()
        except (TypeError, ValueError):
            return None
        # JSON escapes the text (non-ASCII as \uXXXX): the answer may be longer than its text.
        return whole if whole is not None and len(whole) <= self.max_bytes else None

    def _whole(self) -> bytes | None:
        choices = []
        for index in sorted(self._choices):
            c = self._choices[index]
            if "finish_reason" not in c:
                return None
            text = c["text"].text()
            if self._chat:
                message = {"role": c["role"], "content": text}
                choices.append(
                    {"index": index, "message": message, "finish_reason": c["finish_reason"]}
                )
            else:
                choices.append({"index": index, "text": text, "finish_reason": c["finish_reason"]})
        obj = "chat.completion" if self._chat else "text_completion"
        whole: dict[str, Any] = {**self._head, "object": obj, "choices": choices}
        if self._usage is not None:
            whole["usage"] = self._usage
        return json.dumps(whole).encode()


def wants_usage(body: Mapping[str, Any]) -> bool:
    """Whether a streaming request asks for the usage chunk (``stream_options.include_usage``),
    which the stream ends with only then."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def replayable(path: str, entry: CacheEntry) -> bool:
    try:
        replay_sse(path, entry)
    except ValueError:
        return False
    return True


def replay_sse(path: str, entry: CacheEntry, usage: bool = False) -> list[bytes]:
    """A whole cached answer as the SSE events of a stream the openai client parses, ending
    with the usage chunk when the request asks for it (``usage``, `wants_usage`) and only
    then: a live stream has no chunk with empty choices unless asked, and a client reading
    ``chunk.choices[0]`` failed on cache hits alone. Asked for, and none was stored (an entry
    assembled from a stream that did not carry it), the stream ends without it: the openai
    client reads a missing usage as None, and an answer beats none."""
    try:
        whole = json.loads(entry.body)
    except ValueError:
        raise ValueError("cached body is not JSON") from None
    if not isinstance(whole, dict) or not isinstance(whole.get("choices"), list):
        raise ValueError("cached body has no choices to stream")
    chat = whole.get("object") == "chat.completion" or path.endswith("/chat/completions")
    head = {
        "id": whole.get("id", "cached"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": whole.get("created", int(entry.created)),
        "model": whole.get("model", entry.model),
    }
    events: list[bytes] = []

    def emit(obj: dict[str, Any]) -> None:
        events.append(b"data: " + json.dumps(obj).encode() + b"\n\n")

    for choice in whole["choices"]:
        if not isinstance(choice, dict):
            raise ValueError("cached choice is not an object")
        index = choice.get("index", 0)
        if choice.get("logprobs") is not None:
            # A stream of ours carries none, so the replay would drop them unsaid (a stored
            # non-stream answer that asked for them, replayed to a stream that asks too).
            raise ValueError("cached choice carries logprobs")
        if chat:
            message = choice.get("message") or {}
            if not isinstance(message, dict) or _more_than_text(message):
                raise ValueError("cached message carries more than text (tool calls ...)")
            delta = {
                "role": message.get("role", "assistant"),
                "content": message.get("content") or "",
            }
            emit({**head, "choices": [{"index": index, "delta": delta, "finish_reason": None}]})
            end = {"index": index, "delta": {}, "finish_reason": choice.get("finish_reason")}
        else:
            text = choice.get("text", "")
            emit({**head, "choices": [{"index": index, "text": text, "finish_reason": None}]})
            end = {"index": index, "text": "", "finish_reason": choice.get("finish_reason")}
        emit({**head, "choices": [end]})
    if usage and whole.get("usage"):
        emit({**head, "choices": [], "usage": whole["usage"]})
    events.append(b"data: [DONE]\n\n")
    return events
