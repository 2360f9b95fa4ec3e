"""Streams and the cache: family keys, the backend switch, and streams exactly as the repo's
emulator writes them (compact JSON, role chunk, usage chunk) assembled and replayed both ways."""

from __future__ import annotations

import errno
import json
import mmap
import tracemalloc
from typing import Any

import pytest
from promptlb.emulator._reply import Reply, words
from promptlb.middleware._cache import CacheEntry, MemoryCache, RedisCache, cache_key, open_cache
from promptlb.middleware._sse import MAX_CHOICES, StreamAssembler, replay_sse

from tests.middleware.conftest import OpenAIOver

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def test_models_of_one_family_share_a_key() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    a = cache_key(CHAT, {**body, "model": "llama-8b-a"}, "llama-8b")
    b = cache_key(CHAT, {**body, "model": "llama-8b-b"}, "llama-8b")
    assert a is not None and a == b


async def test_the_backend_is_chosen_by_name_or_url() -> None:
    opts: dict[str, Any] = {
        "max_bytes": 1000,
        "ttl": 1.0,
        "prefix": "p:",
        "timeout": 0.05,
        "on_error": lambda op: None,
    }
    assert isinstance(open_cache("memory", **opts), MemoryCache)
    for url in ("redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0", "unix:///tmp/none.sock"):
        cache = open_cache(url, **opts)
        assert isinstance(cache, RedisCache) and cache.name == "redis"
        await cache.close()  # no I/O happened: closing an unused client is fine
    with pytest.raises(ValueError, match="unknown cache backend"):
        open_cache("memcached://x", **opts)


async def test_storing_a_key_again_replaces_it_without_counting_it_twice() -> None:
    cache = MemoryCache(max_bytes=10_000, ttl=60)
    first = CacheEntry(body=b"a" * 50, model="m", created=1.0)
    await cache.put("k", first)
    size = cache.size_bytes
    await cache.put("k", CacheEntry(body=b"b" * 50, model="m", created=2.0))
    assert len(cache) == 1 and cache.size_bytes == size
    got = await cache.get("k")
    assert got is not None and got.body == b"b" * 50


def emulator_stream(reply: Reply, per_event: int = 3) -> bytes:
    """The bytes of the emulator's ``_stream`` for this reply, without the pacing."""
    out = [reply.event({"role": "assistant", "content": ""}, None)] if reply.chat else []
    for sent in range(0, reply.n_out, per_event):
        out.append(reply.event(words(sent, min(per_event, reply.n_out - sent)), None))
    out += [reply.event("", "length"), reply.usage_event(), b"data: [DONE]\n\n"]
    return b"".join(out)


def assemble(chat: bool, data: bytes, step: int) -> dict[str, Any] | None:
    assembler = StreamAssembler(chat)
    for i in range(0, len(data), step):
        assembler.feed(data[i : i + step])
    body = assembler.result()
    return None if body is None else json.loads(body)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("step", [1, 11, 4096])
def test_an_emulator_stream_assembles_into_its_whole_answer(chat: bool, step: int) -> None:
    reply = Reply(chat=chat, model="big", n_in=4, n_out=10, body={})
    assert assemble(chat, emulator_stream(reply), step) == reply.whole()


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_stream_the_engine_cut_is_not_kept(reason: str) -> None:
    # vLLM ends an aborted request with finish_reason "abort", then a normal [DONE]: the half
    # answer was kept and replayed to every twin request.
    reply = Reply(chat=True, model="big", n_in=4, n_out=4, body={})
    cut = reply.event(words(0, 2), None) + reply.event("", reason) + b"data: [DONE]\n\n"
    assert assemble(True, cut, 4096) is None
    for end in ("stop", "length", "eos_token", "stop_sequence"):  # (TGI names its own ends)
        whole = reply.event(words(0, 2), None) + reply.event("", end) + b"data: [DONE]\n\n"
        assert assemble(True, whole, 4096) is not None, end


@pytest.mark.parametrize("chat", [True, False])
def test_a_replay_assembles_back_into_what_was_stored(chat: bool) -> None:
    whole = Reply(chat=chat, model="big", n_in=4, n_out=10, body={}).whole()
    entry = CacheEntry(body=json.dumps(whole).encode(), model="big", created=0.0)
    events = replay_sse(CHAT if chat else COMPLETIONS, entry, usage=True)
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    assert events[-1] == b"data: [DONE]\n\n"
    assert assemble(chat, b"".join(events), 13) == whole


async def test_a_completions_replay_is_parsed_by_the_openai_client(openai_over: OpenAIOver) -> None:
    whole = Reply(chat=False, model="big", n_in=4, n_out=10, body={}).whole()
    entry = CacheEntry(body=json.dumps(whole).encode(), model="big", created=0.0)
    events = replay_sse(COMPLETIONS, entry, usage=True)

    async with openai_over(COMPLETIONS, events) as api:
        stream = await api.completions.create(
            model="big", prompt="hi", stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == words(0, 10)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 14


def _chunk(choice: dict[str, Any]) -> bytes:
    event = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return b"data: " + json.dumps({**event, "choices": [choice]}).encode() + b"\n\n"


@pytest.mark.parametrize(
    "choice",
    [
        {"index": 0, "delta": "x", "finish_reason": "stop"},
        {"index": 0, "delta": {"content": ["a"]}, "finish_reason": "stop"},
        {"index": "0", "delta": {"content": "a"}, "finish_reason": "stop"},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "t"}]}, "finish_reason": None},
        {"index": 0, "delta": {"content": "a"}, "logprobs": {"content": []}},
    ],
)
def test_odd_or_richer_streams_are_not_kept_and_never_raise(choice: dict[str, Any]) -> None:
    assembler = StreamAssembler(chat=True)
    assembler.feed(_chunk({"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}))
    assembler.feed(_chunk(choice))
    assembler.feed(_chunk({"index": 1, "delta": {"content": "b"}, "finish_reason": "stop"}))
    assembler.feed(b"data: [DONE]\n\n")
    assert assembler.result() is None


def test_answers_that_carry_more_than_text_are_not_replayed() -> None:
    calls = {"role": "assistant", "content": None, "tool_calls": [{"id": "t", "type": "function"}]}
    body = {"object": "chat.completion", "choices": [{"index": 0, "message": calls}]}
    with pytest.raises(ValueError, match="more than text"):
        replay_sse("/v1/chat/completions", CacheEntry(json.dumps(body).encode(), "m", 0.0))
    with pytest.raises(ValueError, match="not an object"):
        replay_sse("/v1/chat/completions", CacheEntry(b'{"choices": ["x"]}', "m", 0.0))


def test_an_answer_with_logprobs_is_not_replayed() -> None:
    # A stream of ours carries none: a stored non-stream answer that asked for them was
    # replayed to a stream that asks too, without them, unsaid.
    logprobs = {"content": [{"token": "hi", "logprob": -0.1}]}
    message = {"role": "assistant", "content": "hi"}
    body = {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "logprobs": logprobs}],
    }
    with pytest.raises(ValueError, match="logprobs"):
        replay_sse("/v1/chat/completions", CacheEntry(json.dumps(body).encode(), "m", 0.0))


def test_empty_extras_of_real_servers_do_not_stop_a_replay_or_a_store() -> None:
    # vLLM's every message has "tool_calls": [], OpenAI's "annotations": []: none of their
    # answers could be replayed to a streaming client, nor their streams stored.
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "hi",
        "tool_calls": [],
        "annotations": [],
        "refusal": None,
        "reasoning_content": None,
    }
    body = {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }
    events = replay_sse("/v1/chat/completions", CacheEntry(json.dumps(body).encode(), "m", 0.0))
    assembler = StreamAssembler(chat=True, max_bytes=10_000)
    for event in events:
        assembler.feed(event)
    stored = assembler.result()
    assert stored is not None
    assert json.loads(stored)["choices"][0]["message"]["content"] == "hi"
    delta = {"index": 0, "delta": {"content": "x", "tool_calls": []}, "finish_reason": "stop"}
    again = StreamAssembler(chat=True, max_bytes=10_000)
    again.feed(_chunk(delta))
    again.feed(b"data: [DONE]\n\n")
    assert again.result() is not None


@pytest.mark.parametrize(("choices", "kept"), [(MAX_CHOICES, True), (MAX_CHOICES + 1, False)])
def test_a_stream_of_more_choices_than_n_allows_is_not_kept(choices: int, kept: bool) -> None:
    """Each choice costs a page of memory map and a dict whatever its text, which the bound
    on text bytes did not see: 20,000 one-byte choices held 86 MB for 20 KB of text."""
    assembler = StreamAssembler(chat=True, max_bytes=1_000_000)
    for index in range(choices):
        assembler.feed(_chunk({"index": index, "delta": {"content": "x"}, "finish_reason": "stop"}))
    assembler.feed(b"data: [DONE]\n\n")
    stored = assembler.result()
    assert (stored is not None) is kept
    if stored is not None:
        assert len(json.loads(stored)["choices"]) == MAX_CHOICES


def test_zero_temperatures_share_a_key_and_nan_is_not_cached() -> None:
    body = {"messages": [{"role": "user", "content": "q"}]}
    zero = cache_key("/v1/chat/completions", {**body, "temperature": 0}, "m")
    assert zero is not None
    assert zero == cache_key("/v1/chat/completions", {**body, "temperature": 0.0}, "m")
    nan = {**body, "temperature": float("nan")}
    assert cache_key("/v1/chat/completions", nan, "m") is None


def test_a_stream_too_long_to_store_lets_go_of_what_it_assembled() -> None:
    """A long stream is not kept: its text is let go as soon as it passes the limit, not held
    until the stream ends (a thousand of them held a gigabyte)."""
    recorder = StreamAssembler(True, max_bytes=200)
    event = b'data: {"choices": [{"index": 0, "delta": {"content": "word "}}]}\n\n'
    for _ in range(30):  # 2 KB of events, 150 bytes of text
        recorder.feed(event)
    assert recorder._choices  # assembling while the text is under the limit
    for _ in range(11):
        recorder.feed(event)
    assert recorder._choices == {} and recorder.result() is None


def test_the_limit_bounds_the_answer_kept_not_the_events_that_carried_it() -> None:
    """Token by token, a stream's events are some fifty times its text: a bound on them kept
    no answer longer than a few thousand tokens."""
    pieces = ["word "] * 2000  # 10 KB of text in 160 KB of events
    events = _token_by_token(pieces)
    assert sum(map(len, events)) > 100_000
    recorder = StreamAssembler(True, max_bytes=16 * 1024)
    for event in events:
        recorder.feed(event)
    whole = recorder.result()
    assert whole is not None and len(whole) <= 16 * 1024
    assert json.loads(whole)["choices"][0]["message"]["content"] == "".join(pieces)


def test_an_answer_longer_than_the_limit_once_escaped_is_not_kept() -> None:
    pieces = ["世界"] * 500  # 3,000 bytes of UTF-8, 6,000 of JSON escapes
    recorder = StreamAssembler(True, max_bytes=4096)
    for event in _token_by_token(pieces):
        recorder.feed(event)
    assert recorder._choices[0]["text"].size == 3000  # the text fitted
    assert recorder.result() is None
    roomy = StreamAssembler(True, max_bytes=8192)
    for event in _token_by_token(pieces):
        roomy.feed(event)
    assert roomy.result() is not None


def test_an_event_longer_than_the_limit_is_not_held_until_it_ends() -> None:
    recorder = StreamAssembler(True, max_bytes=1024)
    recorder.feed(b'data: {"choices": [{"index": 0, "delta": {"content": "')
    for _ in range(3):
        recorder.feed(b"x" * 500)  # no line end yet
    assert recorder._buffer == b""
    recorder.feed(b'"}}]}\n\ndata: [DONE]\n\n')
    assert recorder.result() is None


def _token_by_token(pieces: list[str]) -> list[bytes]:
    """A chat stream of one event per piece, as a server streaming token by token sends it."""
    events = [_chunk({"index": 0, "delta": {"role": "assistant"}, "finish_reason": None})]
    events += [_chunk({"index": 0, "delta": {"content": p}, "finish_reason": None}) for p in pieces]
    end = _chunk({"index": 0, "delta": {}, "finish_reason": "stop"})
    return [*events, end, b"data: [DONE]\n\n"]


# Multi-byte text, a surrogate pair's character and a lone surrogate (JSON may carry one as
# \ud800): the kept text must come out as it went in.
PIECES = ["Hé", "llo", " 世界", " 🙂", "\ud800", " ok", "\n"]


def test_a_token_by_token_stream_holds_no_object_per_token_and_comes_out_byte_identical() -> None:
    pieces = PIECES * 3000  # 21,000 tokens, 76 KB of UTF-8: past the first memory map
    text = "".join(pieces)
    recorder = StreamAssembler(True, max_bytes=16 * 1024 * 1024)
    events = _token_by_token(pieces)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for event in events:
            recorder.feed(event)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # A str per token would be over a megabyte here (about 50 bytes an object).
    assert held < 16 * 1024, held
    whole = {
        "id": "c",
        "created": 1,
        "model": "m",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
    }
    assert recorder.result() == json.dumps(whole).encode()
    assert recorder.result() == json.dumps(whole).encode()  # asked again: the same


def test_giving_up_a_stream_empties_the_text_it_kept_at_once() -> None:
    recorder = StreamAssembler(True, max_bytes=4096)
    events = _token_by_token(PIECES * 300)  # 7,500 bytes of text
    for event in events[:10]:
        recorder.feed(event)
    kept = recorder._choices[0]["text"]
    assert kept.size > 0
    for event in events[10:]:
        recorder.feed(event)
    assert recorder.result() is None
    assert kept.size == 0 and kept.text() == ""


def test_a_memory_map_refused_leaves_the_stream_out_of_the_cache_without_raising(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refused)
    recorder = StreamAssembler(True)
    for event in _token_by_token(PIECES):
        recorder.feed(event)
    assert recorder.result() is None
