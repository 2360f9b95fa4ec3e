"""The OpenAI-compatible endpoints, end to end through the real ``promptlb-emulator`` process."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from promptlb.emulator._app import _asked_tokens, _bad_length
from promptlb.emulator._prompt import prompt_blocks
from promptlb.sidecar import parse_engine_metrics

if TYPE_CHECKING:
    from tests.emulator.conftest import Emulator, StartEmulator

TIMEOUT = aiohttp.ClientTimeout(total=30)
POLL_S = 0.02


def _client(emu: Emulator) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{emu.url}/v1", api_key="x", max_retries=0, timeout=30)


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _sse(resp: aiohttp.ClientResponse) -> list[str]:
    """The ``data:`` payloads of a server-sent-event response, in order."""
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    payloads: list[str] = []
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data: "):
            payloads.append(line.removeprefix("data: "))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return payloads


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def _wait_for_load(
    session: aiohttp.ClientSession, url: str, running: int, waiting: int, timeout_s: float = 10.0
) -> None:
    """Poll /metrics (bounded) until it shows these running and waiting counts."""
    deadline = time.monotonic() + timeout_s
    seen: tuple[float, float] = (-1, -1)
    while time.monotonic() < deadline:
        m = await _metrics(session, url)
        seen = (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"])
        if seen == (running, waiting):
            return
        await asyncio.sleep(POLL_S)
    pytest.fail(f"/metrics never showed running={running} waiting={waiting}; last {seen}")


def _word_count(text: str) -> int:
    return len(text.split())


# ---------------------------------------------------------------------------- models, health


async def test_models_lists_every_model_name_repeated_and_comma_separated(
    shared_emulator: Emulator,
) -> None:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(f"{shared_emulator.url}/v1/models") as resp,
    ):
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["emulated", "alt", "third"]
    assert all(m["object"] == "model" for m in body["data"])

    client = _client(shared_emulator)
    try:
        listed = [m.id async for m in client.models.list()]
    finally:
        await client.close()
    assert listed == ["emulated", "alt", "third"]


async def test_health_is_ok_once_loaded(shared_emulator: Emulator) -> None:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(f"{shared_emulator.url}/health") as resp,
    ):
        assert resp.status == 200
        assert await resp.json() == {"status": "ok"}


async def test_health_is_503_while_loading_then_200(start_emulator: StartEmulator) -> None:
    load_s = 2.0
    emu = start_emulator("--load-time-s", str(load_s), "--ttft-ms", "0")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(f"{emu.url}/health") as resp:
            assert resp.status == 503
            assert await resp.json() == {"status": "loading"}
        status, body = await _post(session, f"{emu.url}/v1/chat/completions", chat)
        assert status == 503
        assert body["error"]["code"] == 503

        ready_at = None
        deadline = time.monotonic() + load_s + 15
        while time.monotonic() < deadline:
            async with session.get(f"{emu.url}/health") as resp:
                if resp.status == 200:
                    ready_at = time.monotonic()
                    break
                assert resp.status == 503
            await asyncio.sleep(0.05)
        assert ready_at is not None, "never became healthy"
        # The load time is counted from inside the process, which started after started_at.
        assert ready_at - emu.started_at >= load_s
        status, body = await _post(session, f"{emu.url}/v1/chat/completions", chat)
        assert status == 200


# ---------------------------------------------------------------------------- chat


async def test_chat_non_stream_with_the_openai_client(shared_emulator: Emulator) -> None:
    client = _client(shared_emulator)
    try:
        reply = await client.chat.completions.create(
            model="alt",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=9,
        )
    finally:
        await client.close()
    assert reply.object == "chat.completion"
    assert reply.model == "alt"
    assert len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content is not None
    assert _word_count(choice.message.content) == 9
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 9
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 9


_HI: list[Any] = [{"role": "user", "content": "Say something."}]


async def _chunks(client: openai.AsyncOpenAI, **asked: Any) -> list[Any]:
    """A streamed chat's chunks, ``asked`` over model "alt" and a one-line prompt."""
    stream = await client.chat.completions.create(
        **{"model": "alt", "messages": _HI, **asked, "stream": True}
    )
    return [chunk async for chunk in stream]


async def test_an_answer_that_ends_by_itself_stops_and_one_cut_by_max_tokens_is_length(
    shared_emulator: Emulator,
) -> None:
    """Every answer said "length", as if cut off, also one of a drawn length with no
    max_tokens asked; and a chat's id is vLLM's chatcmpl-."""
    client = _client(shared_emulator)
    try:
        free = await client.chat.completions.create(model="alt", messages=_HI)
        cut = await client.chat.completions.create(model="alt", messages=_HI, max_tokens=3)
        chunks = await _chunks(client)
    finally:
        await client.close()
    assert (free.choices[0].finish_reason, cut.choices[0].finish_reason) == ("stop", "length")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert free.id.startswith("chatcmpl-")


async def test_n_choices_come_whole_and_streamed(shared_emulator: Emulator) -> None:
    """n was ignored: one choice came back whatever was asked."""
    client = _client(shared_emulator)
    try:
        whole = await client.chat.completions.create(model="alt", messages=_HI, max_tokens=4, n=3)
        usage = {"include_usage": True}
        chunks = await _chunks(client, max_tokens=4, n=2, stream_options=usage)
    finally:
        await client.close()
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    text: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
    assert sorted(text) == [0, 1] and all(_word_count(t) == 4 for t in text.values())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


async def test_chat_stream_with_the_openai_client_and_include_usage(
    shared_emulator: Emulator,
) -> None:
    client = _client(shared_emulator)
    try:
        chunks = await _chunks(
            client,
            model="third",
            messages=[{"role": "user", "content": "Stream please."}],
            max_tokens=12,
            stream_options={"include_usage": True},
        )
    finally:
        await client.close()
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.model == "third" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert _word_count(text) == 12
    assert sum(1 for c in with_choices if c.choices[0].delta.content) > 1  # really streamed
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    usage_chunk = chunks[-1]  # after the finish, the usage chunk with no choices
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize(
    ("limit", "include_usage"),
    [({"max_tokens": 1}, False), ({"max_tokens": 13}, True), ({"max_completion_tokens": 6}, True)],
)
async def test_chat_stream_raw_sse(
    shared_emulator: Emulator, limit: dict[str, int], include_usage: bool
) -> None:
    n_out = next(iter(limit.values()))
    body: dict[str, Any] = {
        "model": "emulated",
        "messages": [{"role": "user", "content": "x" * 40}],
        "stream": True,
        **limit,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(f"{shared_emulator.url}/v1/chat/completions", json=body) as resp,
    ):
        payloads = await _sse(resp)
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    chunks = [json.loads(p) for p in payloads[:-1]]
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert c["model"] == "emulated"
        assert isinstance(c["created"], int)
    if include_usage:
        usage = chunks.pop()
        assert usage["choices"] == []
        assert usage["usage"]["completion_tokens"] == n_out
        assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + n_out
    assert all("usage" not in c for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(d.get("content", "") for d in deltas)
    assert _word_count(text) == n_out


@pytest.mark.parametrize("stream_options", [True, "include_usage", [1]])
async def test_malformed_stream_options_never_truncate_the_stream(
    shared_emulator: Emulator, stream_options: object
) -> None:
    """``stream_options`` that is not an object: a 400 up front (as OpenAI and vLLM answer), or at
    the very least a complete stream. Never a 200 stream cut off before ``[DONE]``."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": stream_options,
    }
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(f"{shared_emulator.url}/v1/chat/completions", json=body) as resp,
    ):
        if resp.status == 400:
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
            return
        try:
            payloads = await _sse(resp)
        except aiohttp.ClientPayloadError as exc:
            pytest.fail(f"200 stream cut off before [DONE]: {exc}")
    assert payloads[-1] == "[DONE]"


# ---------------------------------------------------------------------------- completions


async def test_completions_non_stream_and_stream(shared_emulator: Emulator) -> None:
    url = f"{shared_emulator.url}/v1/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        status, body = await _post(session, url, {"prompt": "Once upon a time", "max_tokens": 5})
        assert status == 200
        assert body["object"] == "text_completion"
        assert body["model"] == "emulated"  # the first model is the default
        assert body["choices"][0]["finish_reason"] == "length"
        assert _word_count(body["choices"][0]["text"]) == 5
        assert body["usage"]["completion_tokens"] == 5

        # A pre-tokenised prompt counts one token per id.
        status, body = await _post(session, url, {"prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 1})
        assert status == 200
        assert body["usage"]["prompt_tokens"] == 7

        stream_body = {"model": "alt", "prompt": "Once", "max_tokens": 11, "stream": True}
        async with session.post(url, json=stream_body) as resp:
            payloads = await _sse(resp)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == "alt" for c in chunks)
    assert _word_count("".join(c["choices"][0]["text"] for c in chunks)) == 11
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------- embeddings


async def test_embeddings_with_the_openai_client(shared_emulator: Emulator) -> None:
    client = _client(shared_emulator)
    try:
        first = await client.embeddings.create(model="emulated", input=["alpha", "beta"])
        again = await client.embeddings.create(model="emulated", input="alpha")
    finally:
        await client.close()
    assert [d.index for d in first.data] == [0, 1]
    vectors = [d.embedding for d in first.data]
    assert all(len(v) == 8 for v in vectors)  # --embedding-dim 8, not the default 16
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-9) for v in vectors)
    assert vectors[0] != vectors[1]
    assert again.data[0].embedding == vectors[0]
    assert first.usage.prompt_tokens > 0


async def test_embeddings_are_deterministic_per_input(shared_emulator: Emulator) -> None:
    url = f"{shared_emulator.url}/v1/embeddings"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        s1, one = await _post(session, url, {"input": "same text"})
        s2, two = await _post(session, url, {"input": "same text"})
        s3, batch = await _post(session, url, {"input": ["other", "same text", "same text"]})
        s4, tokens = await _post(session, url, {"input": [101, 102, 103]})
        s5, token_batch = await _post(session, url, {"input": [[101, 102, 103], [7]]})
    assert (s1, s2, s3, s4, s5) == (200, 200, 200, 200, 200)
    vec = one["data"][0]["embedding"]
    assert len(vec) == 8
    assert two["data"][0]["embedding"] == vec
    assert one["object"] == "list"
    assert one["data"][0]["object"] == "embedding"
    assert [d["index"] for d in batch["data"]] == [0, 1, 2]
    assert batch["data"][1]["embedding"] == vec
    assert batch["data"][2]["embedding"] == vec
    assert batch["data"][0]["embedding"] != vec
    assert len(tokens["data"]) == 1  # a list of ids is one pre-tokenised input
    assert tokens["usage"]["prompt_tokens"] == 3
    assert len(token_batch["data"]) == 2
    assert token_batch["data"][0]["embedding"] == tokens["data"][0]["embedding"]


# ---------------------------------------------------------------------------- errors


async def test_unknown_model_is_an_openai_style_404(shared_emulator: Emulator) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for path, body in [
            ("/v1/chat/completions", {"model": "nope", "messages": []}),
            ("/v1/completions", {"model": "nope", "prompt": "x"}),
            ("/v1/embeddings", {"model": "nope", "input": "x"}),
        ]:
            async with session.post(f"{shared_emulator.url}{path}", json=body) as resp:
                assert resp.status == 404, path
                assert resp.content_type == "application/json"
                err = (await resp.json())["error"]
            assert err["code"] == 404
            assert "nope" in err["message"]
            assert isinstance(err["type"], str)

    client = _client(shared_emulator)
    try:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}]
            )
    finally:
        await client.close()
    assert info.value.status_code == 404
    assert "nope" in info.value.message


@pytest.mark.parametrize(
    ("path", "data"),
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b""),
        ("/v1/chat/completions", b"\xff\xfe"),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", b'{"model": "emulated"}'),  # no messages
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b'{"max_tokens": 3}'),  # no prompt
        ("/v1/completions", b'{"prompt": "x", "n": 0}'),
        ("/v1/chat/completions", b'{"messages": [], "n": "2"}'),
        ("/v1/embeddings", b"{not json"),
        ("/v1/embeddings", b'{"input": []}'),
        ("/v1/embeddings", b'{"input": 5}'),
        # vLLM refuses these; 0, a negative, a fraction or true were served as if not asked.
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}], "max_tokens": 0}'),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}], "max_tokens": -3}'),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}], "max_tokens": 2.5}'),
        # Prompts vLLM refuses, served before as one token of their JSON.
        ("/v1/chat/completions", b'{"messages": "hello"}'),
        ("/v1/chat/completions", b'{"messages": []}'),
        ("/v1/chat/completions", b'{"messages": {}}'),
        ("/v1/chat/completions", b'{"messages": [5]}'),
        ("/v1/completions", b'{"prompt": []}'),
        ("/v1/completions", b'{"prompt": [[]]}'),
        ("/v1/completions", b'{"prompt": [1.5]}'),
        ("/v1/completions", b'{"prompt": ["a", [1]]}'),
        ("/v1/completions", b'{"prompt": 5}'),
        ("/v1/completions", b'{"prompt": ""}'),
        ("/v1/completions", b'{"prompt": ["a", ""]}'),
        ("/v1/completions", b'{"prompt": [-1]}'),
        ("/v1/completions", b'{"prompt": [[1], [1099511627776]]}'),
        # (A chat's field: a completion's is ignored, as vLLM ignores it there.)
        (
            "/v1/chat/completions",
            b'{"messages": [{"content": "x"}], "max_completion_tokens": true}',
        ),
        # Past the context (here the KV cache's tokens): 10^9 tokens emptied the cache.
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 1000000000}'),
        # Each of these was a plain-text 500, which a gateway charges to the node: an integer
        # past Python's 4,300 digits, nesting past the parser's stack, an input no
        # embeddings API takes (its walk overflowed the stack), the faults endpoint alike.
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"),
        ("/v1/chat/completions", b"[" * 100_000),
        ("/v1/embeddings", b'{"input": ' + b"[" * 900 + b'"x"' + b"]" * 900 + b"}"),
        ("/v1/embeddings", b'{"input": [["a"]]}'),
        ("/v1/embeddings", b'{"input": [true, 2]}'),
        ("/_emulator/faults", b'{"slow_factor": 1' + b"0" * 5000 + b"}"),
    ],
)
async def test_bad_requests_are_openai_style_400(
    shared_emulator: Emulator, path: str, data: bytes
) -> None:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(
            f"{shared_emulator.url}{path}",
            data=data,
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        assert resp.status == 400
        err = (await resp.json())["error"]
    assert err["code"] == 400
    assert err["type"] == "invalid_request_error"
    assert err["message"]


# ---------------------------------------------------------------------------- metrics, queueing


async def test_metrics_count_the_traffic(shared_emulator: Emulator) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        before = await _metrics(session, shared_emulator.url)
        chat = {"messages": [{"role": "user", "content": "count me"}], "max_tokens": 4}
        status, _ = await _post(session, f"{shared_emulator.url}/v1/chat/completions", chat)
        assert status == 200
        after = await _metrics(session, shared_emulator.url)
    assert after["vllm:request_success_total"] == before["vllm:request_success_total"] + 1
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 4
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert 0 <= after["vllm:kv_cache_usage_perc"] <= 1


async def test_a_non_streamed_answer_counts_its_tokens_as_they_decode(
    start_emulator: StartEmulator,
) -> None:
    # vLLM counts every decode step: counted at the end, a sidecar read 0 tokens/s for the
    # whole answer, then a spike.
    emu = start_emulator("--ttft-ms", "0", "--tokens-per-s", "40")
    chat = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 80}  # 2 s
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        task = asyncio.create_task(_post(session, f"{emu.url}/v1/chat/completions", chat))
        await asyncio.sleep(1.0)
        midway = (await _metrics(session, emu.url))["vllm:generation_tokens_total"]
        status, _ = await task
        after = (await _metrics(session, emu.url))["vllm:generation_tokens_total"]
    assert status == 200 and after == 80
    assert 0 < midway < 80


async def test_requests_beyond_the_slots_really_queue(start_emulator: StartEmulator) -> None:
    ttft_s, tokens_per_s, max_tokens = 0.1, 10, 8
    per_request_s = ttft_s + max_tokens / tokens_per_s  # 0.9 s in a slot
    emu = start_emulator(
        "--slots", "2", "--ttft-ms", str(ttft_s * 1000), "--tokens-per-s", str(tokens_per_s)
    )
    chat = {"messages": [{"role": "user", "content": "q"}], "max_tokens": max_tokens}
    url = f"{emu.url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        start = time.monotonic()
        tasks = [asyncio.create_task(_post(session, url, chat)) for _ in range(6)]
        await _wait_for_load(session, emu.url, running=2, waiting=4)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        wall = time.monotonic() - start
        idle = await _metrics(session, emu.url)
    assert [status for status, _ in results] == [200] * 6
    # 6 requests through 2 slots: 3 rounds of the per-request duration at least (5% for timers).
    assert wall >= 3 * per_request_s * 0.95, wall
    assert (idle["vllm:num_requests_running"], idle["vllm:num_requests_waiting"]) == (0, 0)
    assert idle["vllm:request_success_total"] == 6


async def test_full_queue_is_429_and_clients_going_away_free_their_places(
    start_emulator: StartEmulator,
) -> None:
    emu = start_emulator("--slots", "1", "--max-queue", "1", "--ttft-ms", "600000")
    chat = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 1}
    url = f"{emu.url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        holder = asyncio.create_task(_post(session, url, chat))
        await _wait_for_load(session, emu.url, running=1, waiting=0)
        queued = asyncio.create_task(_post(session, url, chat))
        await _wait_for_load(session, emu.url, running=1, waiting=1)
        status, body = await _post(session, url, chat)
        assert status == 429
        assert body["error"]["code"] == 429

        # The two clients give up: their connections close and the server frees slot and place.
        holder.cancel()
        queued.cancel()
        await asyncio.gather(holder, queued, return_exceptions=True)
        await _wait_for_load(session, emu.url, running=0, waiting=0)


async def test_the_oracle_endpoint_tells_the_true_wait_and_cache(
    start_emulator: StartEmulator,
) -> None:
    """What the bench's live oracle asks each node: the wait a newcomer would have (one slot,
    held for 5 s by an answer of 500 tokens at 100/s: long beside a loaded machine's delays)
    and what of its prompt is cached."""
    emu = start_emulator(
        *("--slots", "1", "--ttft-ms", "0", "--prefill-tokens-per-s", "20000"),
        *("--tokens-per-s", "100", "--kv-blocks", "1000", "--stream-interval-ms", "20"),
    )
    history = [{"role": "system", "content": "You are terse. " * 140}]  # ~500 tokens
    first = {"messages": [*history, {"role": "user", "content": "q1"}], "max_tokens": 500}
    oracle = f"{emu.url}/_emulator/oracle"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        status, idle = await _post(http, oracle, first)
        assert status == 200 and idle["wait_s"] == 0 and idle["cached_tokens"] == 0
        assert idle["service_s"] == pytest.approx(idle["prompt_tokens"] / 20000 + 5.0, rel=0.01)
        async with http.post(f"{emu.url}/v1/chat/completions", json={**first, "stream": True}) as r:
            await r.content.readline()  # streaming: its slot is held until the last token
            nxt = {"messages": [*history, {"role": "user", "content": "q2"}], "max_tokens": 10}
            _, busy = await _post(http, oracle, nxt)
            _, other = await _post(http, oracle, {"messages": [{"role": "user", "content": "x"}]})
            await r.read()
        _, after = await _post(http, oracle, nxt)
    assert 2.5 < busy["wait_s"] <= 5.0
    assert busy["cached_tokens"] >= 480  # the history, held by the running request
    assert other["cached_tokens"] == 0 and other["wait_s"] == pytest.approx(busy["wait_s"], abs=1.0)
    assert after["wait_s"] == 0 and after["cached_tokens"] == busy["cached_tokens"]


async def test_the_oracle_sees_slots_held_by_embeddings(start_emulator: StartEmulator) -> None:
    # Embeddings hold slots but stayed out of the forecast: a wait of 0 on a full node.
    emu = start_emulator("--slots", "1", "--ttft-ms", "3000")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        embedding = asyncio.create_task(_post(http, f"{emu.url}/v1/embeddings", {"input": "x"}))
        await asyncio.sleep(0.5)
        _, busy = await _post(http, f"{emu.url}/_emulator/oracle", {"prompt": "hi"})
        assert (await embedding)[0] == 200
        _, after = await _post(http, f"{emu.url}/_emulator/oracle", {"prompt": "hi"})
    assert 2.0 < busy["wait_s"] <= 3.0 and after["wait_s"] == 0


async def test_a_request_left_during_its_prefill_leaves_only_what_it_computed(
    start_emulator: StartEmulator,
) -> None:
    """A client gone 0.3 s into a 2.5 s prefill left the whole prompt cached, as if computed:
    the next asker found it all (the losing node of a hedge got the prefix for free)."""
    emu = start_emulator(
        *("--ttft-ms", "0", "--prefill-tokens-per-s", "200", "--kv-blocks", "1000"),
    )
    body = {"messages": [{"role": "system", "content": "You are terse. " * 140}], "max_tokens": 2}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        asking = asyncio.ensure_future(http.post(f"{emu.url}/v1/chat/completions", json=body))
        await asyncio.sleep(0.3)
        asking.cancel()  # the connection closes: the emulator lets go
        await asyncio.sleep(0.3)
        _, seen = await _post(http, f"{emu.url}/_emulator/oracle", body)
    assert seen["prompt_tokens"] >= 480
    assert seen["cached_tokens"] <= 0.5 * seen["prompt_tokens"]  # about a fifth was computed


async def test_a_conversations_next_turn_prefills_only_what_is_not_cached(
    start_emulator: StartEmulator,
) -> None:
    """Prefill costs the prompt tokens the KV cache lacks: a second turn that resends the
    history pays for its new tail only, and vLLM's prefix-cache counters follow."""
    # 500 prompt tokens at 200/s: a cold prefill of 2.5 s, far beside a loaded machine's jitter.
    emu = start_emulator(
        *("--ttft-ms", "0", "--prefill-tokens-per-s", "200", "--kv-blocks", "1000"),
        *("--tokens-per-s", "1000", "--stream-interval-ms", "5"),
    )
    history = [{"role": "system", "content": "You are terse. " * 140}]  # ~2,000 bytes, 500 tok

    async def first_chunk(http: aiohttp.ClientSession, messages: list[dict[str, str]]) -> float:
        body = {"model": "emulated", "messages": messages, "max_tokens": 2, "stream": True}
        started = time.perf_counter()
        async with http.post(f"{emu.url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            await response.content.readany()
            took = time.perf_counter() - started
            await response.read()
        return took

    async with aiohttp.ClientSession() as http:
        cold = await first_chunk(http, [*history, {"role": "user", "content": "first"}])
        history += [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
        warm = await first_chunk(http, [*history, {"role": "user", "content": "second"}])
        async with http.get(f"{emu.url}/metrics") as response:
            text = await response.text()
        async with http.get(f"{emu.url}/_emulator/stats") as response:
            stats = await response.json()
    assert cold >= 2.0  # ~500 tokens at 200/s
    assert warm < cold / 2  # its new tail only: ~0.1 s
    metrics = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    queried = metrics["vllm:prefix_cache_queries_total"]
    hits = metrics["vllm:prefix_cache_hits_total"]
    assert hits >= 480  # the whole history but its last partial block
    assert queried > hits + 480  # the first turn found nothing
    # Both requests finished: vLLM's gauge counts their cached blocks as free; the emulator's
    # stats say how full the cache is.
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    assert 0 < stats["kv_filled"] <= 0.1
    # Its capacity as vLLM publishes it, which the sidecar reads into the snapshot.
    assert parse_engine_metrics(text).kv_tokens == 1000 * 16


async def test_the_first_token_comes_with_the_end_of_prefill(
    start_emulator: StartEmulator,
) -> None:
    """As an engine sends it, and as the simulator times it: not held for the first event's
    interval (here 1.6 s, sixteen tokens at 10 tokens/s: far from the right answer's 50 ms on
    a loaded machine), while the rest keep their pace."""
    emu = start_emulator(
        "--model", "m", "--ttft-ms", "50", "--tokens-per-s", "10", "--stream-interval-ms", "1600"
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 17}
    body["stream"] = True
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(f"{emu.url}/v1/chat/completions", json=body) as resp,
    ):
        started = time.monotonic()
        first = None
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first = time.monotonic() - started
        whole = time.monotonic() - started
    assert first is not None and first < 0.8, first  # 50 ms of prefill, not 50 + 1600
    assert whole >= 17 / 10 - 0.05, whole  # the rest at 10 tokens/s, the last where it was


async def test_each_endpoint_reads_its_own_field_and_the_oracle_as_it_is_told(
    shared_emulator: Emulator,
) -> None:
    # A body with both fields: the completions route reads its prompt, the chat route its
    # messages, and the oracle the endpoint's it is given (it read the messages for both).
    body = {"prompt": "p" * 3000, "messages": [{"role": "user", "content": "m" * 6000}]}
    url = shared_emulator.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        _, completion = await _post(session, f"{url}/v1/completions", {**body, "max_tokens": 1})
        _, chat = await _post(session, f"{url}/v1/chat/completions", {**body, "max_tokens": 1})
        asked = {}
        for flag in ("0", "1"):
            async with session.post(f"{url}/_emulator/oracle?chat={flag}", json=body) as resp:
                asked[flag] = (await resp.json())["prompt_tokens"]
        # Told no endpoint, messages that are no list are no chat (the shared rule's reading).
        odd = {"messages": "text", "prompt": "p" * 3000}
        async with session.post(f"{url}/_emulator/oracle", json=odd) as resp:
            untold = (await resp.json())["prompt_tokens"]
    assert completion["usage"]["prompt_tokens"] == asked["0"] == untold == 750
    assert chat["usage"]["prompt_tokens"] == asked["1"] > 1500


async def test_a_client_that_leaves_while_queued_is_counted_cancelled(
    start_emulator: StartEmulator,
) -> None:
    # Only a client that left while in a slot was counted: a hedge's loser that queued, or one
    # held by a hang, went unseen, and requests no longer added up.
    emu = start_emulator("--slots", "1", "--ttft-ms", "0", "--tokens-per-s", "10")
    url = f"{emu.url}/v1/chat/completions"
    long = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 50}  # 5 s in the slot
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        holder = asyncio.create_task(_post(session, url, long))
        await _wait_for_load(session, emu.url, running=1, waiting=0)
        queued = asyncio.create_task(_post(session, url, long))
        await _wait_for_load(session, emu.url, running=1, waiting=1)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        deadline = time.monotonic() + 5
        while True:
            async with session.get(f"{emu.url}/_emulator/stats") as response:
                stats = await response.json()
            if stats["cancelled"] == 1 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
    assert stats["cancelled"] == 1


def test_a_token_id_prompt_takes_a_block_per_16_ids() -> None:
    # Their JSON text stood for them (about seven bytes an id): twice the blocks pinned.
    n, blocks = prompt_blocks(list(range(1000, 1032)), chat=False)
    assert (n, len(blocks)) == (32, 2)
    assert prompt_blocks(list(range(1000, 1032)), chat=False) == (n, blocks)  # equal ids alike


async def test_an_answer_past_the_context_is_refused_and_leaves_the_cache_as_it_was(
    start_emulator: StartEmulator,
) -> None:
    emu = start_emulator("--ttft-ms", "0", "--tokens-per-s", "100000", "--kv-blocks", "64")
    prompt = {"prompt": "a shared prefix " * 200}  # about 800 tokens: 50 of the 64 blocks
    url = f"{emu.url}/v1/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        assert (await _post(session, url, {**prompt, "max_tokens": 8}))[0] == 200
        status, err = await _post(session, url, {**prompt, "max_tokens": 10**9})
        assert status == 400 and "maximum context length is 1024 tokens" in err["error"]["message"]
        assert (await _post(session, url, {**prompt, "max_tokens": 8}))[0] == 200
        metrics = await _metrics(session, emu.url)
        # Not asked, the answer is what the context leaves: no 400 for what was not asked.
        assert (await _post(session, url, prompt))[0] == 200
    hits = metrics["vllm:prefix_cache_hits_total"]
    assert hits >= 48 * 16  # the second ask found the first's blocks: nothing was evicted


async def test_a_batch_of_prompts_is_answered_and_paid_for_prompt_by_prompt(
    shared_emulator: Emulator,
) -> None:
    """vLLM answers each prompt of a batch ``n`` times (choice index prompt * n + j) and counts
    every prompt's tokens; the first prompt alone was answered and counted (one choice and a
    fiftieth of the tokens for a batch of 50). The context bounds each prompt, not their sum."""
    url = f"{shared_emulator.url}/v1/completions"
    one = "x" * 400  # 100 tokens under the rule
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        status, single = await _post(session, url, {"prompt": one, "max_tokens": 2})
        assert status == 200 and single["usage"]["prompt_tokens"] == 100
        status, batch = await _post(session, url, {"prompt": [one] * 3, "max_tokens": 2, "n": 2})
        assert status == 200
        assert [c["index"] for c in batch["choices"]] == list(range(6))
        assert batch["usage"] == {
            "prompt_tokens": 300,
            "completion_tokens": 12,
            "total_tokens": 312,
        }
        status, ids = await _post(session, url, {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 1})
        assert status == 200 and len(ids["choices"]) == 2
        assert ids["usage"]["prompt_tokens"] == 5
        # Each of 200 prompts of 100 tokens fits the 16,384-token context; together, in the
        # one slot the emulator runs a batch in, they took the whole KV cache and emptied it.
        status, many = await _post(session, url, {"prompt": [one] * 200, "max_tokens": 2})
        assert status == 400 and "KV cache of 16384 tokens" in many["error"]["message"]
        status, wide = await _post(session, url, {"prompt": "x", "max_tokens": 1000, "n": 128})
        assert status == 400 and "KV cache of 16384 tokens" in wide["error"]["message"]
        status, wide = await _post(session, url, {"prompt": ["a"] * 9, "n": 128, "max_tokens": 1})
        assert status == 400 and "1024 choices" in wide["error"]["message"]


async def test_a_null_model_is_the_served_one_as_in_vllm(shared_emulator: Emulator) -> None:
    body = {"model": None, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        status, answer = await _post(session, f"{shared_emulator.url}/v1/chat/completions", body)
    assert status == 200 and answer["model"] == "emulated"


async def test_a_charset_python_does_not_know_is_a_400_not_a_crash(
    shared_emulator: Emulator,
) -> None:
    headers = {"Content-Type": "application/json; charset=bogus"}
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(
            f"{shared_emulator.url}/v1/chat/completions", data=b"{}", headers=headers
        ) as resp,
    ):
        assert resp.status == 400 and (await resp.json())["error"]["code"] == 400


def test_an_explicit_null_max_tokens_does_not_hide_max_completion_tokens() -> None:
    assert _asked_tokens({"max_tokens": None, "max_completion_tokens": 5}) == 5
    assert _asked_tokens({"max_tokens": 7, "max_completion_tokens": 5}) == 5  # as vLLM reads
    # A completion has max_tokens alone: vLLM ignores the other there (and does not refuse
    # it: a 0 or a string in it was a 400).
    assert _asked_tokens({"max_tokens": 7, "max_completion_tokens": 5}, chat=False) == 7
    assert _bad_length({"max_completion_tokens": "abc"}, 1, 1, 100, chat=False) is None
    assert _bad_length({"max_completion_tokens": 0}, 1, 1, 100) is not None
