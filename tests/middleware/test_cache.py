"""The response cache: keys, the memory LRU, stream assembly, SSE replay (parsed by the openai
client) and the Redis backend against a real redis-server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx
import msgpack
import pytest
import redis.asyncio
from openai.types.chat import ChatCompletionChunk
from promptlb.middleware import PromptLBMiddleware
from promptlb.middleware._cache import (
    CacheEntry,
    MemoryCache,
    RedisCache,
    cache_key,
    sampled,
)
from promptlb.middleware._redis import MAX_CONNECTIONS
from promptlb.middleware._sse import StreamAssembler, replay_sse

from tests.conftest import Launcher, RedisServer
from tests.middleware.conftest import OpenAIOver

CHAT = "/v1/chat/completions"
BODY = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def key(body: dict[str, Any], model: str = "big") -> str | None:
    return cache_key(CHAT, body, model)


def test_the_key_covers_what_changes_the_answer_and_nothing_else() -> None:
    base = key(BODY)
    assert base is not None and base == key(dict(BODY))
    assert key({**BODY, "stream": True, "user": "u1", "stream_options": {}}) == base
    assert key({**BODY, "messages": [{"role": "user", "content": "ho"}]}) != base
    assert key({**BODY, "max_tokens": 9}) != base
    assert key(BODY, model="small") != base
    assert cache_key("/v1/completions", BODY, "big") != base
    # Sampled answers are stored too (under their own temperature): only a twin matches.
    warm = key({**BODY, "temperature": 0.7})
    assert warm is not None and warm != base
    assert key({"model": "big"}) is None
    embed = {"model": "e", "input": ["x"], "temperature": 1}
    assert cache_key("/v1/embeddings", embed, "e") is not None
    # What asks the same is one key: 1 and 1.0 for a real-valued field, null and no field.
    assert key({**BODY, "top_p": 1}) == key({**BODY, "top_p": 1.0}) != base
    no_temp = {k: v for k, v in BODY.items() if k != "temperature"}
    assert key({**no_temp, "temperature": None}) == key(no_temp)
    assert key({**BODY, "seed": 2**60}) != key({**BODY, "seed": 2**60 + 1})  # never as floats
    assert key({**BODY, "top_p": 10**400}) is not None  # no float holds it: kept as it is
    # A temperature too: an OverflowError (a 500) where a float could not hold it.
    assert key({**BODY, "temperature": 10**400}) not in (None, base)


def test_a_sample_is_told_from_a_deterministic_answer() -> None:
    no_temp = {k: v for k, v in BODY.items() if k != "temperature"}
    assert not sampled(CHAT, BODY)
    assert sampled(CHAT, {**BODY, "temperature": 0.7})
    assert sampled(CHAT, no_temp)  # OpenAI's default temperature is 1
    assert not sampled(CHAT, no_temp, default_temperature=0.0)
    assert sampled(CHAT, {**BODY, "temperature": "hot"})
    assert sampled(CHAT, {**BODY, "temperature": 10**400})
    assert not sampled(CHAT, {**BODY, "temperature": -(10**400)})
    assert not sampled("/v1/embeddings", {"model": "e", "input": ["x"], "temperature": 1})


def entry(text: str = "x" * 100, created: float = 0.0) -> CacheEntry:
    return CacheEntry(body=text.encode(), model="big", created=created)


def test_an_entry_from_a_replica_whose_clock_runs_ahead_is_not_fresh() -> None:
    # Served as fresh by every other replica for as long as the skew, past the ttl.
    now = 1_000_000.0
    assert entry(created=now - 10).fresh(now, ttl=300)
    assert entry(created=now + 2).fresh(now, ttl=300)  # clocks a little apart: in step
    assert not entry(created=now + 600).fresh(now, ttl=300)
    assert not entry(created=now - 301).fresh(now, ttl=300)


def test_entries_round_trip_and_garbage_is_refused() -> None:
    e = entry("hello", 12.5)
    assert CacheEntry.unpack(e.pack()) == e
    for bad in (b"\x00garbage", b"\x93\x01\x02\x03", json.dumps({"b": 1}).encode()):
        with pytest.raises(ValueError, match="not a cache entry"):
            CacheEntry.unpack(bad)


async def test_memory_cache_evicts_least_recent_by_bytes_and_expires() -> None:
    now = [1000.0]
    one = len("k0") + len(entry().pack())
    cache = MemoryCache(max_bytes=3 * one, ttl=60, clock=lambda: now[0])
    for i in range(3):
        await cache.put(f"k{i}", entry())
    assert await cache.get("k0") is not None  # k0 is now the most recent
    await cache.put("k3", entry())
    assert len(cache) == 3 and cache.size_bytes <= 3 * one
    assert await cache.get("k1") is None and await cache.get("k0") is not None
    await cache.put("huge", entry("y" * 4 * one))
    assert await cache.get("huge") is None
    now[0] += 61
    assert await cache.get("k0") is None and len(cache) == 2


def sse(events: list[dict[str, Any]], done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chat_chunk(delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "big",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


CHAT_STREAM = [
    chat_chunk({"role": "assistant", "content": ""}),
    chat_chunk({"content": "the quick "}),
    chat_chunk({"content": "brown fox"}),
    chat_chunk({}, "stop"),
    {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "big",
        "choices": [],
        "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5},
    },
]


def feed(assembler: StreamAssembler, data: bytes, step: int = 7) -> None:
    for i in range(0, len(data), step):  # split anywhere, mid-line included
        assembler.feed(data[i : i + step])


def test_a_chat_stream_is_assembled_into_the_whole_answer() -> None:
    assembler = StreamAssembler(chat=True)
    feed(assembler, sse(CHAT_STREAM).replace(b"\n", b"\r\n"))
    whole = json.loads(assembler.result() or b"null")
    assert whole["object"] == "chat.completion" and whole["id"] == "c1"
    assert whole["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "the quick brown fox"},
            "finish_reason": "stop",
        }
    ]
    assert whole["usage"]["total_tokens"] == 5


def test_a_completions_stream_is_assembled_too() -> None:
    events = [
        {
            "id": "t",
            "object": "text_completion",
            "created": 1,
            "model": "big",
            "choices": [{"index": 0, "text": part, "finish_reason": finish}],
        }
        for part, finish in (("one ", None), ("two", None), ("", "length"))
    ]
    assembler = StreamAssembler(chat=False)
    feed(assembler, sse(events), step=5)
    whole = json.loads(assembler.result() or b"null")
    assert whole["choices"][0]["text"] == "one two"
    assert whole["choices"][0]["finish_reason"] == "length"


def test_an_unfinished_broken_or_oversized_stream_is_not_kept() -> None:
    unfinished = StreamAssembler(chat=True)
    feed(unfinished, sse(CHAT_STREAM, done=False))
    assert unfinished.result() is None
    broken = StreamAssembler(chat=True)
    feed(broken, sse([*CHAT_STREAM[:2], {"error": {"message": "boom"}}]))
    assert broken.result() is None
    big = StreamAssembler(chat=True, max_bytes=64)
    feed(big, sse(CHAT_STREAM))
    assert big.result() is None


async def test_a_replay_is_parsed_by_the_openai_client(openai_over: OpenAIOver) -> None:
    assembler = StreamAssembler(chat=True)
    feed(assembler, sse(CHAT_STREAM))
    body = assembler.result()
    assert body is not None
    cached = CacheEntry(body=body, model="big", created=time.time())
    events = replay_sse(CHAT, cached, usage=True)

    async with openai_over(CHAT, events) as api:
        stream = await api.chat.completions.create(
            model="big",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "the quick brown fox"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5
    # Not asked for, no usage chunk: a live stream has no chunk with empty choices then, and
    # a client reading chunk.choices[0] failed on cache hits alone.
    plain = [json.loads(e[6:]) for e in replay_sse(CHAT, cached)[:-1]]
    assert all(event["choices"] and "usage" not in event for event in plain)
    bare = json.loads(body)
    del bare["usage"]
    unknown = CacheEntry(body=json.dumps(bare).encode(), model="big", created=0.0)
    ended = [json.loads(e[6:]) for e in replay_sse(CHAT, unknown, usage=True)[:-1]]
    assert all(event["choices"] for event in ended)  # asked, none stored: ends without it
    with pytest.raises(ValueError, match="no choices"):
        replay_sse("/v1/embeddings", CacheEntry(b'{"object": "list", "data": []}', "e", 0.0))


async def test_redis_keeps_entries_with_a_ttl_under_the_prefix(redis_server: RedisServer) -> None:
    errors: list[str] = []
    cache = RedisCache(redis_server.url, prefix="t:", ttl=30, on_error=errors.append)
    try:
        await cache.put("k", entry("hello", 5.0))
        assert await cache.get("k") == entry("hello", 5.0)
        assert await cache.get("other") is None
        raw = redis.asyncio.Redis.from_url(redis_server.url)
        assert 0 < await raw.pttl("t:k") <= 30_000
        await raw.set("t:bad", b"not msgpack\xff")
        await raw.aclose()
        assert await cache.get("bad") is None and errors == ["corrupt"]
        assert await cache.get("k") is not None  # a corrupt value does not take Redis out
    finally:
        await cache.close()


async def test_a_dead_redis_is_a_quick_miss_then_skipped(redis_server: RedisServer) -> None:
    errors: list[str] = []
    cache = RedisCache(redis_server.url, prefix="t:", ttl=30, timeout=0.05, on_error=errors.append)
    try:
        await cache.put("k", entry())
        redis_server.kill()
        started = time.monotonic()
        assert await cache.get("k") is None
        assert time.monotonic() - started < 1.0  # its 0.05 s timeout, not a connect's seconds
        assert errors == ["get"]
        assert await cache.get("k") is None
        await cache.put("k", entry())
        assert errors == ["get", "skipped", "skipped"]  # not asked: skipped while it is down
        # After the backoff one call probes (and fails again) while the others skip.
        cache._down_until = time.monotonic()
        probes = await asyncio.gather(*(cache.get("k") for _ in range(10)))
        assert probes == [None] * 10
        assert errors.count("get") == 2 and errors.count("skipped") == 11
    finally:
        await cache.close()
    nowhere = RedisCache("redis://127.0.0.1:1/0", prefix="t:", ttl=30, timeout=0.05)
    assert await nowhere.get("k") is None
    await nowhere.close()


async def test_a_burst_of_more_lookups_than_pooled_connections_all_hit(
    redis_server: RedisServer,
) -> None:
    """redis-py's default pool refused every call past 100 connections in use at once: under
    a burst a healthy Redis read as a stream of misses (300 lookups: 200 refused)."""
    errors: list[str] = []
    cache = RedisCache(redis_server.url, prefix="t:", ttl=30, timeout=1.0, on_error=errors.append)
    try:
        await cache.put("k", entry("kept", 1.0))
        got = await asyncio.gather(*(cache.get("k") for _ in range(3 * MAX_CONNECTIONS)))
        assert got == [entry("kept", 1.0)] * (3 * MAX_CONNECTIONS) and errors == []
    finally:
        await cache.close()


async def test_a_call_that_waits_out_of_time_is_busy_and_one_admitted_has_its_own_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each Redis call takes 100 ms, the timeout is 150 ms, 300 calls at once: the first
    hundred are answered at 100 ms, the second, admitted then, at 200 ms (within their own
    timeout: one shared with the wait failed them as an outage), and the third, still
    waiting at 150 ms, are busy: misses that leave Redis's health as it was."""
    errors: list[str] = []
    cache = RedisCache("redis://127.0.0.1:1/0", prefix="t:", ttl=30, timeout=0.15)
    cache._on_error = errors.append
    packed = entry("kept", 1.0).pack()

    async def slow_get(key: str) -> bytes:
        await asyncio.sleep(0.1)
        return packed

    monkeypatch.setattr(cache._client, "get", slow_get)
    try:
        got = await asyncio.gather(*(cache.get("k") for _ in range(3 * MAX_CONNECTIONS)))
    finally:
        await cache.close()
    assert sum(g is not None for g in got) == 2 * MAX_CONNECTIONS
    assert errors == ["busy"] * MAX_CONNECTIONS and cache._down_until == 0.0


async def test_calls_cut_by_the_cache_closing_are_no_redis_failure() -> None:
    """Closing disconnects the calls still in flight: each was counted a Redis failure, and
    set a backoff on a cache being shut down."""
    held: list[asyncio.StreamWriter] = []

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # a Redis that has not answered yet

    server = await asyncio.start_server(slow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    errors: list[str] = []
    cache = RedisCache(
        f"redis://127.0.0.1:{port}/0", prefix="t:", ttl=30, timeout=5.0, on_error=errors.append
    )
    try:
        calls = [asyncio.ensure_future(cache.get("k")) for _ in range(5)]
        await asyncio.sleep(0.2)  # each waiting on its connection for its answer
        await cache.close()
        assert await asyncio.gather(*calls) == [None] * 5
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
    assert "get" not in errors and cache._down_until == 0.0


async def test_calls_that_wait_out_of_time_leave_a_dead_redis_skipped() -> None:
    """A Redis that accepts and never answers: the calls admitted time out and start the
    backoff; those left waiting for a connection said nothing of Redis, but counted as
    refusals they ended the backoff, and hundreds more calls went to the hung Redis."""
    held: list[asyncio.StreamWriter] = []

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(never, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    errors: list[str] = []
    cache = RedisCache(f"redis://127.0.0.1:{port}/0", prefix="t:", ttl=30, on_error=errors.append)
    try:
        await asyncio.gather(*(cache.get("k") for _ in range(3 * MAX_CONNECTIONS)))
        # At most one call per connection reached it; the rest waited, then were skipped.
        assert errors.count("get") <= MAX_CONNECTIONS
        assert set(errors) <= {"get", "busy", "skipped"}
        assert cache._down_until > 0  # still backing off
        assert await cache.get("k") is None and errors[-1] == "skipped"
    finally:
        await cache.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_call_waiting_when_the_cache_closes_opens_no_connection(
    redis_server: RedisServer,
) -> None:
    """A reload replaced the cache during a burst: the calls still waiting for a connection
    went on and opened the closed client's pool again (100 connections left open)."""
    errors: list[str] = []
    cache = RedisCache(redis_server.url, prefix="t:", ttl=30, timeout=5.0, on_error=errors.append)
    calls = [asyncio.ensure_future(cache.get("k")) for _ in range(3 * MAX_CONNECTIONS)]
    await asyncio.sleep(0)  # every call has started: a hundred asking, the rest waiting
    await cache.close()
    await asyncio.gather(*calls)
    pool = cache._client.connection_pool
    assert len(pool._available_connections) + len(pool._in_use_connections) <= MAX_CONNECTIONS


async def test_a_write_redis_refuses_is_a_miss_that_leaves_the_reads_on(
    redis_server: RedisServer,
) -> None:
    # Out of memory under noeviction (Redis's default policy): every put refused. Taken for an
    # outage, each refusal switched the reads off for a second, while GETs worked.
    errors: list[str] = []
    cache = RedisCache(redis_server.url, prefix="t:", ttl=30, on_error=errors.append)
    raw = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await cache.put("k", entry("kept", 1.0))
        await raw.config_set("maxmemory", 1)
        await cache.put("other", entry())
        assert errors == ["refused"]
        assert await cache.get("k") == entry("kept", 1.0)  # not skipped
        assert errors == ["refused"]
        # After an earlier outage's backoff: a refusal says Redis is up, so calls go on
        # together rather than one probe at a time.
        cache._down_until = time.monotonic()
        await cache.put("other", entry())
        assert cache._down_until == 0.0
        got = await asyncio.gather(*(cache.get("k") for _ in range(3)))
        assert got == [entry("kept", 1.0)] * 3 and "skipped" not in errors
    finally:
        await raw.config_set("maxmemory", 0)
        await raw.aclose()
        await cache.close()


@pytest.mark.parametrize(
    ("options", "stored"),
    [
        ({}, 2),  # degraded_sampled is on by default: a sample may stand in when all is down
        ({"degraded_sampled": False}, 1),  # no hop would ever serve the sample: not kept
        ({"degraded_sampled": False, "cache_sampled": True, "serve_fresh": True}, 2),
        # cache_sampled serves fresh answers only under serve_fresh: without it nothing would
        # serve the sample, which took a deterministic answer's room.
        ({"degraded_sampled": False, "cache_sampled": True}, 1),
        # degraded_sampled, but nothing serves an answer degraded (no outage, no cache hop).
        ({"serve_fresh": True, "on_outage": False}, 1),
    ],
)
async def test_a_sampled_answer_is_stored_only_when_some_hop_may_serve_it(
    launch: Launcher, options: dict[str, Any], stored: int
) -> None:
    model = launch("emulator", "--model", "m", "--ttft-ms", "5")
    app = PromptLBMiddleware(
        noop,
        config={"cache": options, "nodes": [{"name": "a", "url": model.url, "models": ["m"]}]},
    )
    chat = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as http:
            for body in ({**chat, "temperature": 0}, chat):  # deterministic, then a sample
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200
        await asyncio.sleep(0.1)  # the store is written in the background
        assert len(app.dispatcher.cache) == stored  # type: ignore[arg-type]
    finally:
        await app.dispatcher.stop()


async def noop(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("balanced routes do not reach the app")


async def test_a_probe_cancelled_on_the_way_lets_the_next_call_probe(
    redis_server: RedisServer,
) -> None:
    """The one call that probes Redis after a failure, cancelled while Redis is slow (its client
    left), settled nothing: every later call skipped Redis until a restart."""
    errors: list[str] = []
    cache = RedisCache(redis_server.url, prefix="t:", ttl=30, timeout=2.0, on_error=errors.append)
    try:
        await cache.put("k", entry())
        cache._down_until = time.monotonic()  # as after a failure, its backoff just over
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # Redis hangs
        try:
            probe = asyncio.create_task(cache.get("k"))
            await asyncio.sleep(0.2)
            probe.cancel()
            with pytest.raises(asyncio.CancelledError):
                await probe
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert await cache.get("k") == entry()  # probed, and Redis is back
        assert "skipped" not in errors
    finally:
        await cache.close()


async def test_a_call_from_before_the_failure_cancelled_during_the_probe_starts_no_second_probe(
    redis_server: RedisServer,
) -> None:
    errors: list[str] = []
    cache = RedisCache(redis_server.url, prefix="t:", ttl=30, timeout=2.0, on_error=errors.append)
    try:
        await cache.put("k", entry())
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # Redis hangs
        try:
            early = asyncio.create_task(cache.get("k"))  # healthy when it started
            await asyncio.sleep(0.1)
            cache._down_until = time.monotonic()  # another call failed; its backoff is over
            probe = asyncio.create_task(cache.get("k"))
            await asyncio.sleep(0.1)
            early.cancel()
            with pytest.raises(asyncio.CancelledError):
                await early
            assert await cache.get("k") is None  # skipped: the probe is still out
            assert errors == ["skipped"]
            probe.cancel()
            with pytest.raises(asyncio.CancelledError):
                await probe
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
    finally:
        await cache.close()


def test_an_entry_marked_without_usage_round_trips_and_an_older_one_has_it() -> None:
    bare = CacheEntry(b"{}", "big", 1.0, usage=False)
    assert CacheEntry.unpack(bare.pack()) == bare
    older = msgpack.packb({"b": b"{}", "m": "big", "c": 1.0, "t": "application/json"})
    assert CacheEntry.unpack(older).usage  # stored before the mark: a node's whole answer


def test_a_stream_tells_whether_it_carried_its_usage() -> None:
    with_usage, without = StreamAssembler(chat=True), StreamAssembler(chat=True)
    feed(with_usage, sse(CHAT_STREAM))
    feed(without, sse(CHAT_STREAM[:-1]))
    assert with_usage.has_usage and not without.has_usage
    assert without.result() is not None  # still kept, for streaming clients


def test_an_error_event_in_either_shape_stops_the_assembly_and_a_null_one_does_not() -> None:
    # vLLM's older {"object": "error"} was assembled around and kept; the Responses API's
    # "error": null on a good event gave the answer up.
    old_vllm = StreamAssembler(chat=True)
    feed(old_vllm, sse([CHAT_STREAM[0], {"object": "error", "message": "boom"}, *CHAT_STREAM[1:]]))
    assert old_vllm.result() is None
    nulls = StreamAssembler(chat=True)
    feed(nulls, sse([{**event, "error": None} for event in CHAT_STREAM]))
    assert json.loads(nulls.result() or b"null")["choices"][0]["message"]["content"] == (
        "the quick brown fox"
    )


def test_what_follows_an_error_in_the_same_chunk_is_not_assembled() -> None:
    # Given up on the error, the rest of the chunk was assembled again, text held for nothing.
    assembler = StreamAssembler(chat=True)
    assembler.feed(sse([{"error": {"message": "boom"}}, chat_chunk({"content": "x" * 100})]))
    assert assembler._choices == {} and assembler._size == 0


async def test_an_entry_redis_cannot_take_is_dropped_without_taking_redis_out(
    redis_server: RedisServer,
) -> None:
    # A header byte that is no UTF-8 reaches the entry as a lone surrogate, which msgpack
    # refuses: counted as a failed write, it skipped Redis for every request for a second.
    errors: list[str] = []
    cache = RedisCache(redis_server.url, prefix="t:", ttl=30, on_error=errors.append)
    try:
        await cache.put("k", entry("kept", 1.0))
        await cache.put("odd", CacheEntry(b"{}", "big", 1.0, "application/json; x=\udcff"))
        assert errors == ["corrupt"]
        assert await cache.get("k") == entry("kept", 1.0) and errors == ["corrupt"]
    finally:
        await cache.close()
