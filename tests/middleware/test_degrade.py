"""Degradation end to end: fallback chains, the response cache (memory and a real Redis),
shedding by priority and hedging, through the example app with real emulators and sidecars."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import httpx
import pytest
import redis.asyncio
from promptlb.middleware import Config, HealthConfig, NodeConfig, PromptLBMiddleware
from promptlb.middleware._answer import Answer
from promptlb.middleware._balancer import Balancer, Try, Upstream
from promptlb.middleware._config import load_config
from promptlb.middleware._degrade import Dispatcher, _first_success
from promptlb.middleware._live import build_live
from promptlb.middleware._refusals import Exhausted, UpstreamError

from tests.conftest import RedisServer, Serve, eventually
from tests.middleware.conftest import Cluster, Flags, MakeCluster, Messages, gateway_over

HEALTH = (
    "[health]\ninterval = '200ms'\ninterval_jitter = '20ms'\ntimeout = '200ms'\n"
    "unhealthy_threshold = 1\n"
)


ChatBody = Callable[..., dict[str, Any]]


@pytest.fixture
def chat_body(hello: Messages) -> ChatBody:
    def make(**extra: Any) -> dict[str, Any]:
        return {"model": "m", "messages": hello, "max_tokens": 6, "temperature": 0, **extra}

    return make


async def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes, float]:
    started = time.monotonic()
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        data = await response.read()
        headers = {k.lower(): v for k, v in response.headers.items()}
        return response.status, headers, data, time.monotonic() - started


async def emulator_stats(url: str) -> dict[str, int]:
    async with aiohttp.ClientSession() as http, http.get(url + "/_emulator/stats") as response:
        body: dict[str, int] = await response.json()
        return body


async def wait_down(c: Cluster, *names: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        states = {n["name"]: n["state"] for n in (await c.status())["nodes"]}
        if all(states[name] != "ready" for name in names):
            return
        assert time.monotonic() < deadline, states
        await asyncio.sleep(0.1)


def kill(c: Cluster, name: str) -> None:
    c.nodes[name].model.proc.kill()
    c.nodes[name].model.proc.wait(timeout=5)


async def test_a_slow_primary_falls_back_to_the_light_model_within_ttft(
    cluster: MakeCluster,
    fast: Flags,
    hello: Messages,
) -> None:
    config = "[[fallback]]\nmodel = 'big'\nthen = ['small']\nttft = '500ms'\n"
    c = cluster(
        {
            "big": ("--model", "big", "--ttft-ms", "5000", "--tokens-per-s", "400"),
            "small": ("--model", "small", *fast),
        },
        config,
    )
    api = c.client()
    await api.chat.completions.create(model="small", messages=hello, max_tokens=2)  # warm
    for stream in (False, True):
        started = time.monotonic()
        raw = await api.chat.completions.with_raw_response.create(
            model="big", messages=hello, max_tokens=4, stream=stream
        )
        parsed = raw.parse()
        if stream:
            text = "".join([ch.choices[0].delta.content or "" async for ch in parsed])  # type: ignore[union-attr]
        else:
            text = parsed.choices[0].message.content or ""  # type: ignore[union-attr]
        elapsed = time.monotonic() - started
        assert text.split() == ["the", "quick", "brown", "fox"]
        # At the chain's ttft, not the primary's 5 s: room beside it for a loaded machine.
        assert 0.5 <= elapsed < 2.5, elapsed
        assert raw.headers["x-promptlb-degraded"] == "fallback"
        assert raw.headers["x-promptlb-model"] == "small"
        assert raw.headers["x-promptlb-node"] == "small"

    # The slow node was told to stop: its generation was cancelled, not left running.
    async def both_cancelled() -> bool:
        return (await emulator_stats(c.nodes["big"].model.url))["cancelled"] >= 2

    await eventually(both_cancelled)
    assert (await emulator_stats(c.nodes["big"].model.url))["cancelled"] == 2


async def test_a_5xx_that_sends_a_request_down_its_chain_counts_against_the_node(
    cluster: MakeCluster, fast: Flags, chat_body: ChatBody
) -> None:
    """The node answered 500: its failure (metrics, outlier detection), not a client abort."""
    config = "[retry]\nattempts = 1\n[[fallback]]\nmodel = 'big'\nthen = ['small']\n"
    c = cluster(
        {
            "big": ("--model", "big", "--error-rate", "1", *fast),
            "small": ("--model", "small", *fast),
        },
        config,
    )
    for _ in range(3):
        status, headers, _, _ = await post(c.app.url, chat_body(model="big"))
        assert (status, headers["x-promptlb-node"]) == (200, "small")
    async with (
        aiohttp.ClientSession() as http,
        http.get(c.app.url + "/_promptlb/metrics") as response,
    ):
        metrics = await response.text()
    assert 'promptlb_requests_total{node="big",outcome="500"} 3.0' in metrics
    assert 'outcome="aborted"' not in metrics


async def test_clients_may_opt_out_of_fallback_only_where_allowed(
    cluster: MakeCluster, fast: Flags, chat_body: ChatBody
) -> None:
    config = (
        "[retry]\nper_try_timeout = '300ms'\n"
        "[[fallback]]\nmodel = 'big'\nthen = ['small']\nttft = '300ms'\n"
        "[[fallback]]\nmodel = 'mid'\nthen = ['small']\nttft = '300ms'\nallow_opt_out = false\n"
    )
    c = cluster(
        {
            "big": ("--model", "big", "--model", "mid", "--ttft-ms", "3000"),
            "small": ("--model", "small", *fast),
        },
        config,
    )
    out = {"x-promptlb-no-fallback": "1"}
    code, headers, _, _ = await post(c.app.url, chat_body(model="big"), out)
    assert code == 504 and "x-promptlb-degraded" not in headers
    code, headers, _, _ = await post(c.app.url, chat_body(model="mid"), out)
    assert code == 200 and headers["x-promptlb-model"] == "small"


async def test_everything_down_serves_the_shared_redis_cache_from_another_replica(
    cluster: MakeCluster, redis_server: RedisServer, fast: Flags, chat_body: ChatBody
) -> None:
    config = (
        HEALTH + f"[cache]\nbackend = '{redis_server.url}'\n"
        "[[fallback]]\nmodel = 'm'\nthen = ['cache']\nttft = '1s'\n"
    )
    c = cluster({"a": fast, "b": fast}, config)
    code, headers, fresh, _ = await post(c.app.url, chat_body())
    assert code == 200 and "x-promptlb-degraded" not in headers
    sampled, _, _, _ = await post(c.app.url, chat_body(temperature=0.7, max_tokens=3))
    await asyncio.sleep(0.2)  # the write is in the background, after the answer
    kill(c, "a")
    kill(c, "b")
    await wait_down(c, "a", "b")
    code, headers, cached, elapsed = await post(c.app.url, chat_body())
    assert code == 200, cached
    assert headers["x-promptlb-degraded"] == "cache"
    assert headers["x-promptlb-node"] == "cache"
    assert cached == fresh
    # A replica that never saw the answer serves it from the same Redis.
    other = c.another_app()
    code, headers, shared, _ = await post(other.url, chat_body())
    assert code == 200 and headers["x-promptlb-degraded"] == "cache" and shared == fresh
    # A sampled answer (temperature > 0) stands in for its twin only now, degraded.
    code, headers, _, _ = await post(c.app.url, chat_body(temperature=0.7, max_tokens=3))
    assert sampled == 200
    assert code == 200 and headers["x-promptlb-degraded"] == "cache"
    # Never answered and nothing up: a quick 503 with Retry-After.
    code, headers, body, elapsed = await post(c.app.url, chat_body(max_tokens=4))
    assert code == 503 and headers["retry-after"].isdigit(), body
    assert b'"error"' in body
    assert elapsed < 2.0, elapsed  # at once, not a timeout: bench/degrade_bench.py times it


async def test_requests_succeed_when_redis_dies_mid_test(
    cluster: MakeCluster, redis_server: RedisServer, fast: Flags, chat_body: ChatBody
) -> None:
    config = f"[cache]\nbackend = '{redis_server.url}'\nserve_fresh = true\ntimeout = '50ms'\n"
    c = cluster({"a": fast}, config)
    code, headers, first, _ = await post(c.app.url, chat_body())
    assert code == 200 and "x-promptlb-cache" not in headers
    stored = redis.asyncio.Redis.from_url(redis_server.url)

    async def written() -> bool:  # the write is in the background, after the answer
        return bool(await stored.keys("*"))

    await eventually(written)
    await stored.aclose()
    code, headers, again, _ = await post(c.app.url, chat_body())
    assert code == 200 and headers["x-promptlb-cache"] == "hit" and again == first
    redis_server.kill()
    for i in range(20):
        code, headers, _, elapsed = await post(c.app.url, chat_body(max_tokens=2 + i % 3))
        assert code == 200 and headers["x-promptlb-node"] == "a"
        assert elapsed < 1.0
    async with (
        aiohttp.ClientSession() as http,
        http.get(c.app.url + "/_promptlb/metrics") as response,
    ):
        metrics = await response.text()
    assert 'promptlb_cache_errors_total{op="get"}' in metrics
    assert 'promptlb_cache_errors_total{op="skipped"}' in metrics


async def test_a_streamed_answer_is_cached_and_replayed_to_the_openai_client(
    cluster: MakeCluster,
    fast: Flags,
    hello: Messages,
) -> None:
    config = HEALTH + "[cache]\n[[fallback]]\nmodel = 'm'\nthen = ['cache']\n"
    c = cluster({"a": fast}, config)
    api = c.client()

    usage: list[int | None] = []

    async def ask(**options: Any) -> tuple[str, str | None, dict[str, str]]:
        raw = await api.chat.completions.with_raw_response.create(
            model="m", messages=hello, max_tokens=9, temperature=0, stream=True, **options
        )
        chunks = [chunk async for chunk in raw.parse()]
        usage.append(next((ch.usage.total_tokens for ch in chunks if ch.usage), None))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finish = next(
            (
                ch.choices[0].finish_reason
                for ch in chunks
                if ch.choices and ch.choices[0].finish_reason
            ),
            None,
        )
        return text, finish, dict(raw.headers)

    text, finish, headers = await ask(stream_options={"include_usage": True})
    assert len(text.split()) == 9 and finish == "length" and usage[0] is not None
    await asyncio.sleep(0.2)
    kill(c, "a")
    await wait_down(c, "a")
    replayed, replay_finish, headers = await ask()
    assert headers["x-promptlb-degraded"] == "cache"
    assert headers["content-type"].startswith("text/event-stream")
    assert (replayed, replay_finish) == (text, finish)
    # The usage chunk only for a stream that asks for it, as a live one.
    asked = await ask(stream_options={"include_usage": True})
    assert asked[0] == text and usage == [usage[0], None, usage[0]]
    # The same answer, asked without streaming, comes back whole.
    whole = await api.chat.completions.create(
        model="m", messages=hello, max_tokens=9, temperature=0
    )
    assert whole.choices[0].message.content == text


@pytest.mark.parametrize("asker", ["whole", "stream with usage"])
async def test_a_stream_kept_without_usage_is_no_fresh_answer_to_one_that_bills_by_it(
    cluster: MakeCluster, fast: Flags, hello: Messages, asker: str
) -> None:
    # Assembled from a stream that did not ask for usage, it was served to the next caller
    # that needed it with none: `resp.usage` None, or no usage chunk, on cache hits only.
    c = cluster({"a": fast}, HEALTH + "[cache]\nserve_fresh = true\n")
    chat = c.client().chat.completions
    streamed = await chat.create(
        model="m", messages=hello, max_tokens=9, temperature=0, stream=True
    )
    text = "".join([ch.choices[0].delta.content or "" async for ch in streamed if ch.choices])

    async def stored() -> bool:  # after the answer: replayed once it is there
        replay = await chat.with_raw_response.create(
            model="m", messages=hello, max_tokens=9, temperature=0, stream=True
        )
        return replay.headers.get("x-promptlb-cache") == "hit"

    await eventually(stored)
    if asker == "whole":
        first = await chat.with_raw_response.create(
            model="m", messages=hello, max_tokens=9, temperature=0
        )
        assert "x-promptlb-cache" not in first.headers  # the node answered
        assert first.parse().usage is not None
        assert first.parse().choices[0].message.content == text
    else:
        billed = await chat.with_raw_response.create(
            model="m",
            messages=hello,
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert "x-promptlb-cache" not in billed.headers  # the node answered
        assert [chunk.usage async for chunk in billed.parse() if chunk.usage]

    async def replaced() -> bool:  # the node's answer, with usage, took the entry's place
        again = await chat.with_raw_response.create(
            model="m", messages=hello, max_tokens=9, temperature=0
        )
        return again.headers.get("x-promptlb-cache") == "hit" and again.parse().usage is not None

    await eventually(replaced)


async def test_a_long_token_by_token_stream_is_kept_by_its_answer_not_its_events(
    cluster: MakeCluster,
    fast: Flags,
    hello: Messages,
) -> None:
    """max_entry_bytes bounds the answer kept: a stream whose events outgrow it, carrying an
    answer well under it, is cached (its events are some fifty times its text)."""
    config = (
        HEALTH + "[cache]\nmax_entry_bytes = 4096\n[[fallback]]\nmodel = 'm'\nthen = ['cache']\n"
    )
    c = cluster({"a": (*fast, "--stream-interval-ms", "1")}, config)  # an event a token
    body = {"model": "m", "messages": hello, "max_tokens": 80, "temperature": 0, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(c.app.url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        events = await response.read()
    assert len(events) > 2 * 4096 and events.count(b"data: ") > 80
    await asyncio.sleep(0.2)
    kill(c, "a")
    await wait_down(c, "a")
    raw = await c.client().chat.completions.with_raw_response.create(
        model="m", messages=hello, max_tokens=80, temperature=0
    )
    assert raw.headers["x-promptlb-degraded"] == "cache"
    whole = raw.parse()
    assert whole.choices[0].message.content is not None
    assert len(whole.choices[0].message.content.split()) == 80


async def test_shedding_by_priority(cluster: MakeCluster, chat_body: ChatBody) -> None:
    config = (
        "[shedding]\nenabled = true\nmax_in_flight = 1\nqueue_timeout = '1s'\n"
        "retry_after = 2\npriority_token = 'letmein'\n"
    )
    # 100 ms to the first token, then 10 tokens/s: max_tokens sets how long a request holds on.
    c = cluster({"a": ("--slots", "4", "--ttft-ms", "100", "--tokens-per-s", "10")}, config)
    url = c.app.url
    # ~8 s: room for every step below on a loaded machine (at ~2 s they could outlast it).
    busy = asyncio.ensure_future(post(url, chat_body(max_tokens=80)))

    async def at_cap() -> bool:  # the node at its cap: the pool is saturated
        return any(n["in_flight"] for n in (await c.status())["nodes"])

    await eventually(at_cap)
    code, headers, _, elapsed = await post(url, chat_body(), {"x-promptlb-priority": "sheddable"})
    assert code == 429 and headers["retry-after"] == "2" and elapsed < 0.9  # at once, no wait
    code, headers, _, elapsed = await post(url, chat_body(), {"x-promptlb-priority": "standard"})
    assert code == 429 and 1.0 <= elapsed < 4.0, elapsed  # its queue_timeout, then refused
    # Raising a priority needs the token: without it "critical" is standard.
    code, _, _, elapsed = await post(url, chat_body(), {"x-promptlb-priority": "critical"})
    assert code == 429 and elapsed >= 1.0
    vip = {"x-promptlb-priority": "critical", "x-promptlb-priority-token": "letmein"}
    code, headers, _, elapsed = await post(url, chat_body(max_tokens=1), vip)
    assert code == 200 and not busy.done()  # through, while the pool is still saturated
    assert (await busy)[0] == 200
    # A standard request that finds room before its queue timeout goes through.
    busy = asyncio.ensure_future(post(url, chat_body(max_tokens=3)))  # ~0.4 s
    await eventually(at_cap)  # (a fixed sleep raced its getting there)
    code, _, _, elapsed = await post(url, chat_body(max_tokens=1))
    assert code == 200 and elapsed >= 0.15
    assert (await busy)[0] == 200


async def test_a_hedge_wins_and_the_loser_is_cancelled_upstream(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    config = (
        "strategy = 'round_robin'\n"
        "[[fallback]]\nmodel = 'm'\nthen = []\nttft = '5s'\nhedge_after = '200ms'\n"
    )
    c = cluster({"slow": ("--ttft-ms", "3000"), "fast": fast}, config)
    api = c.client()
    for _ in range(4):
        started = time.monotonic()
        raw = await api.chat.completions.with_raw_response.create(
            model="m", messages=hello, max_tokens=4
        )
        raw.parse()
        assert raw.headers["x-promptlb-node"] == "fast"
        assert time.monotonic() - started < 1.0
    await asyncio.sleep(0.2)
    slow = await emulator_stats(c.nodes["slow"].model.url)
    assert slow["success"] == 0
    async with aiohttp.ClientSession() as http, http.get(c.app.url + "/_promptlb/metrics") as r:
        metrics = await r.text()
    sent = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith('promptlb_hedges_total{event="sent"}')
    )
    # Every hedge's loser was cancelled on the slow node (its sidecar's warmup may still run).
    assert slow["cancelled"] == sent >= 1


@pytest.mark.parametrize("degraded_sampled", [True, False])
async def test_a_sampled_request_gets_a_stored_answer_only_when_every_node_is_down(
    cluster: MakeCluster, fast: Flags, hello: Messages, degraded_sampled: bool
) -> None:
    """OpenAI's default temperature is 1 and most clients send none: such answers are stored
    too, never served fresh in place of a new sample, and served (marked degraded) when the
    alternative is a 503, unless `degraded_sampled` is off."""
    options = f"serve_fresh = true\ndegraded_sampled = {str(degraded_sampled).lower()}\n"
    c = cluster({"a": fast}, HEALTH + "[cache]\n" + options)
    body = {"model": "m", "messages": hello, "max_tokens": 6}  # no temperature: a sample
    status, headers, first, _ = await post(c.app.url, body)
    assert (status, headers["x-promptlb-node"]) == (200, "a")
    await asyncio.sleep(0.2)  # the store is written in the background
    status, headers, second, _ = await post(c.app.url, body)
    assert (status, headers["x-promptlb-node"]) == (200, "a")  # fresh, yet a new sample
    assert second != first
    await asyncio.sleep(0.2)
    kill(c, "a")
    await wait_down(c, "a")
    status, headers, data, _ = await post(c.app.url, body)
    if degraded_sampled:
        assert (status, headers["x-promptlb-degraded"]) == (200, "cache")
        assert data == second  # the latest stored
    else:
        assert status == 503


async def test_cache_sampled_alone_serves_no_stale_sample_in_an_outage(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    """``cache_sampled`` lets a sample be served fresh; a stale one stands in for an outage
    only under ``degraded_sampled``. One flag for both served it with that one off."""
    options = "serve_fresh = true\ncache_sampled = true\ndegraded_sampled = false\nttl = '1s'\n"
    c = cluster({"a": fast}, HEALTH + "[cache]\n" + options)
    body = {"model": "m", "messages": hello, "max_tokens": 6}  # no temperature: a sample
    status, _, first, _ = await post(c.app.url, body)
    assert status == 200
    await asyncio.sleep(0.2)  # the store is written in the background
    status, headers, again, _ = await post(c.app.url, body)
    assert (status, headers.get("x-promptlb-cache"), again) == (200, "hit", first)  # fresh
    await asyncio.sleep(1.1)  # stale now
    kill(c, "a")
    await wait_down(c, "a")
    status, headers, _, _ = await post(c.app.url, body)
    assert status == 503 and "x-promptlb-degraded" not in headers


async def test_a_node_that_breaks_off_before_its_first_byte_is_retried_else_a_502(
    serve: Serve,
) -> None:
    """A 200 whose body never comes (the node closes before its first byte, as a stream's
    headers go out before its prefill) is that try's failure, charged to the node: tried again
    elsewhere, since nothing reached the client; with nowhere else, a 502 in the OpenAI shape,
    never aiohttp's payload error escaping as a 500."""
    from aiohttp import web
    from promptlb.middleware import PromptLBMiddleware

    async def broken(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": "100"})
        await response.prepare(request)
        assert request.transport is not None
        request.transport.close()
        return response

    async def sound(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    async def noop(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not reached")

    bad_app, good_app = web.Application(), web.Application()
    bad_app.router.add_post("/v1/chat/completions", broken)
    good_app.router.add_post("/v1/chat/completions", sound)
    async with serve(bad_app) as bad, serve(good_app) as good:
        for nodes in (
            [{"name": "bad", "url": bad}, {"name": "good", "url": good}],
            [{"name": "bad", "url": bad}],
        ):
            app = PromptLBMiddleware(
                noop,
                config={"nodes": nodes, "health": {"enabled": False}, "strategy": "round_robin"},
            )
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                got = [
                    await http.post("/v1/chat/completions", json={"model": "m", "prompt": "x"})
                    for _ in range(4)
                ]
            if len(nodes) == 2:
                assert {(r.status_code, r.headers["x-promptlb-node"]) for r in got} == {
                    (200, "good")
                }
                # Round robin tried the broken node first at least once: two tries then.
                assert "2" in {r.headers["x-promptlb-attempts"] for r in got}
            else:
                assert {r.status_code for r in got} == {502}, got[0].text
                assert got[0].json()["error"]["type"] == "upstream_error"
                assert "broke off" in got[0].json()["error"]["message"]
            assert app.balancer.table.nodes["bad"].failures >= 1
            assert app.balancer.table.nodes["bad"].view.in_flight == 0
            await app.dispatcher.stop()


async def test_a_client_leaving_while_the_hedge_loser_unwinds_still_settles_the_winner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unit: the dispatcher's hedge bookkeeping, with its attempts stood in for. The winner is
    chosen, then the client leaves while the loser is still unwinding: the winner's answer is
    never handed over, and its try must be settled anyway (else its node stays counted busy
    and its connection held for good)."""
    nodes = [{"name": n, "url": "http://127.0.0.1:9", "models": ["m"]} for n in ("a", "b")]
    fallback = [{"model": "m", "then": [], "hedge_after": "10ms"}]
    live = build_live(load_config({"nodes": nodes, "fallback": fallback}))
    dispatcher = live.dispatcher
    table = live.balancer.table
    for node in table.nodes.values():  # both ready: the hedge has somewhere to go
        table.record_health(node, True, "ok", time.monotonic())
    settled: list[BaseException | None] = []

    class Held:
        def close(self, exc: BaseException | None = None) -> None:
            settled.append(exc)

    calls = 0

    async def attempt(*_: object) -> Answer:
        nonlocal calls
        calls += 1
        if calls == 1:  # the first try: slow, and slow to unwind once cancelled
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await asyncio.sleep(0.1)
                raise
        await asyncio.sleep(0.02)
        return Answer("m", held=cast(Try, Held()))

    monkeypatch.setattr(dispatcher, "_attempt", attempt)
    request = live.reader.build("/v1/chat/completions", {"model": "m", "messages": []})
    chain = live.config.fallback[0]
    task = asyncio.ensure_future(dispatcher._try_model(request, chain, False, None))
    await asyncio.sleep(0.06)  # the hedge went at 10 ms and won at 30; the loser unwinds
    assert calls == 2 and not settled and not task.done()
    task.cancel()  # the client leaves
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.2)
    assert len(settled) == 1 and isinstance(settled[0], asyncio.CancelledError)


def hedged_to_next(monkeypatch: pytest.MonkeyPatch, small_fails: bool) -> tuple[Any, list[str]]:
    """A dispatcher whose model ``m`` has one node, hedged after 10 ms to ``small``; its
    attempts stood in for: ``m`` fails at 50 ms, ``small`` at 20 ms or answers then."""
    nodes = [
        {"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]},
        {"name": "b", "url": "http://127.0.0.1:9", "models": ["small"]},
    ]
    fallback = [{"model": "m", "then": ["small"], "hedge_after": "10ms"}]
    live = build_live(load_config({"nodes": nodes, "fallback": fallback}))
    table = live.balancer.table
    for node in table.nodes.values():
        table.record_health(node, True, "ok", time.monotonic())
    tried: list[str] = []

    async def attempt(
        request: Any, first: object, total: object, avoid: set[str], *_: object
    ) -> Answer:
        tried.append(request.model)
        avoid.add("a" if request.model == "m" else "b")  # as a try on the model's one node
        await asyncio.sleep(0.05 if request.model == "m" else 0.02)
        if request.model == "m" or small_fails:
            raise UpstreamError(502, f"{request.model} failed", 1)
        return Answer(request.model)

    monkeypatch.setattr(live.dispatcher, "_attempt", attempt)
    return live, tried


async def test_a_hedge_to_the_next_hop_that_fails_leaves_it_a_try_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The hedge had only what was left of the first deadline, and as a hedge a final hop's
    # own refusal is not passed on: the next hop is still tried as itself. The refusal counts
    # the tries of both racers and the hop's own.
    live, tried = hedged_to_next(monkeypatch, small_fails=True)
    request = live.reader.build("/v1/chat/completions", {"model": "m", "messages": []})
    with pytest.raises(Exhausted) as info:
        await live.dispatcher._find(request, live.config.fallback[0])
    assert tried == ["m", "small", "small"]
    assert info.value.attempts == 3


async def test_a_hedge_to_the_next_hop_that_wins_counts_as_a_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    live, _ = hedged_to_next(monkeypatch, small_fails=False)
    request = live.reader.build("/v1/chat/completions", {"model": "m", "messages": []})
    answer = await live.dispatcher._find(request, live.config.fallback[0])
    assert (answer.model, answer.degraded) == ("small", "fallback")
    registry = live.balancer.metrics.registry
    labels = {"model": "m", "to": "small"}
    assert registry.get_sample_value("promptlb_fallbacks_total", labels) == 1


async def test_a_client_leaving_while_the_cache_is_asked_for_a_refusals_stand_in_settles_the_try(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unit: the last hop answered 503 and the cache is asked for a stand-in; the client leaves
    meanwhile. The 503's try was never handed on, so nothing else settled it: its node stayed
    counted busy and its connection held."""
    nodes = [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}]
    live = build_live(load_config({"nodes": nodes, "cache": {}}))
    dispatcher = live.dispatcher
    settled: list[BaseException | None] = []

    class Held:
        def close(self, exc: BaseException | None = None) -> None:
            settled.append(exc)

    refused = SimpleNamespace(response=SimpleNamespace(status=503), node=SimpleNamespace(name="a"))

    async def try_model(*_: object) -> Answer:
        return Answer("m", upstream=cast(Any, refused), held=cast(Try, Held()))

    async def slow_cache(*_: object) -> Answer | None:
        await asyncio.sleep(3600)
        return None

    monkeypatch.setattr(dispatcher, "_try_model", try_model)
    monkeypatch.setattr(dispatcher, "_stand_in", slow_cache)
    request = live.reader.build("/v1/chat/completions", {"model": "m", "messages": []})
    task = asyncio.ensure_future(dispatcher._find(request, None))
    await asyncio.sleep(0.05)
    task.cancel()  # the client leaves
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(settled) == 1 and isinstance(settled[0], asyncio.CancelledError)


async def test_with_a_cache_and_no_chain_a_nodes_own_refusal_is_passed_on_unless_one_is_stored(
    serve: Serve,
) -> None:
    """`[cache]` adds answers and changes nothing else: with no chain, a node's final 5xx (its
    error body, its Retry-After) reaches the client as without it, unless a stored answer
    stands in. It used to become the gateway's own "a node answered 500" with our Retry-After."""
    from aiohttp import web

    failing = {"now": False}

    async def node(request: web.Request) -> web.Response:
        if failing["now"]:
            error = {"error": {"message": "engine overloaded", "type": "engine", "code": 500}}
            return web.json_response(error, status=500, headers={"Retry-After": "7"})
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    stored = {"model": "m", "prompt": "stored", "temperature": 0}
    fresh = {"model": "m", "prompt": "never asked before", "temperature": 0}
    async with gateway_over(serve, {"/v1/completions": node}, cache={}) as (app, http):
        assert (await http.post("/v1/completions", json=stored)).status_code == 200
        await asyncio.sleep(0.1)  # the store is written in the background
        failing["now"] = True
        got = await http.post("/v1/completions", json=fresh)
        assert got.status_code == 500
        assert got.json()["error"]["message"] == "engine overloaded"
        assert (got.headers["retry-after"], got.headers["x-promptlb-node"]) == ("7", "n")
        got = await http.post("/v1/completions", json=stored)
        assert got.status_code == 200
        assert got.headers["x-promptlb-degraded"] == "cache"
        assert got.json()["choices"][0]["message"]["content"] == "ok"
        assert app.balancer.table.nodes["n"].failures == 2  # both 500s were the node's
        assert app.balancer.table.nodes["n"].view.in_flight == 0


async def test_a_fallbacks_answer_is_never_the_primarys_fresh_hit_in_one_family(
    serve: Serve,
) -> None:
    """With ``big`` and ``small`` one cache family, small's fallback answer was stored under
    the family's key and then served to big's requests as a fresh hit, unmarked."""
    from aiohttp import web

    big_up = {"now": False}

    async def node(request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        if model == "big" and not big_up["now"]:
            return web.json_response({"error": {"message": "down"}}, status=503)
        return web.json_response({"choices": [{"message": {"content": f"from {model}"}}]})

    body = {"model": "big", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    config = {
        "fallback": [{"model": "big", "then": ["small"]}],
        "cache": {"serve_fresh": True, "families": {"big": "llama", "small": "llama"}},
    }
    async with gateway_over(serve, {"/v1/chat/completions": node}, **config) as (_, http):
        got = await http.post("/v1/chat/completions", json=body)
        assert got.headers["x-promptlb-degraded"] == "fallback"
        await asyncio.sleep(0.1)  # the store is written in the background
        big_up["now"] = True
        got = await http.post("/v1/chat/completions", json=body)
        assert got.json()["choices"][0]["message"]["content"] == "from big"
        assert "x-promptlb-cache" not in got.headers
        await asyncio.sleep(0.1)
        again = await http.post("/v1/chat/completions", json=body)  # big's own: fresh
        assert again.headers["x-promptlb-cache"] == "hit"
        assert again.json()["choices"][0]["message"]["content"] == "from big"


async def test_an_opt_out_of_the_chain_still_gets_no_lighter_models_answer_as_fresh(
    serve: Serve,
) -> None:
    """``x-promptlb-no-fallback`` drops the chain for the request; the guard against the
    chain's lighter models posing as the primary was built from the dropped chain, and
    small's answer (stored by a request of its own, under the family's key) passed for big's."""
    from aiohttp import web

    async def node(request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        return web.json_response({"choices": [{"message": {"content": f"from {model}"}}]})

    small = {"model": "small", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    config = {
        "fallback": [{"model": "big", "then": ["small"]}],
        "cache": {"serve_fresh": True, "families": {"big": "llama", "small": "llama"}},
    }
    async with gateway_over(serve, {"/v1/chat/completions": node}, **config) as (_, http):
        got = await http.post("/v1/chat/completions", json=small)
        assert got.json()["choices"][0]["message"]["content"] == "from small"
        await asyncio.sleep(0.1)  # the store is written in the background
        opted = {"x-promptlb-no-fallback": "1"}
        got = await http.post("/v1/chat/completions", json={**small, "model": "big"}, headers=opted)
        assert got.json()["choices"][0]["message"]["content"] == "from big"
        assert "x-promptlb-cache" not in got.headers


async def test_an_opt_out_gets_the_outage_not_a_stale_answer(serve: Serve) -> None:
    """``x-promptlb-no-fallback`` asks for the model's own answer or the error: it dropped the
    lighter models only, and an outage still served the opted-out client a stale answer."""
    from aiohttp import web

    up = {"now": True}

    async def node(request: web.Request) -> web.Response:
        if not up["now"]:
            return web.json_response({"error": {"message": "down"}}, status=503)
        return web.json_response({"choices": [{"message": {"content": "fresh"}}]})

    body = {"model": "big", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    async with gateway_over(serve, {"/v1/chat/completions": node}, cache={}) as (_, http):
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        await asyncio.sleep(0.1)  # the store is written in the background
        up["now"] = False
        stale = await http.post("/v1/chat/completions", json=body)
        assert stale.status_code == 200 and stale.headers["x-promptlb-degraded"] == "cache"
        opted = {"x-promptlb-no-fallback": "1"}
        refused = await http.post("/v1/chat/completions", json=body, headers=opted)
        assert refused.status_code == 503 and "x-promptlb-degraded" not in refused.headers


async def test_a_lighter_model_whose_context_is_too_short_is_passed_over(serve: Serve) -> None:
    """big -> small, small's context 1,000 tokens: with big down, a request for 5,000 tokens
    went to small and came back its 400 ("too long"), telling the client its request was bad
    (no retry) where big was only down; the chain's cache was never asked either."""
    from aiohttp import web

    asked: list[str] = []

    async def node(request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        asked.append(model)
        if model == "big":
            return web.json_response({"error": {"message": "down"}}, status=503)
        return web.json_response({"choices": [{"message": {"content": f"from {model}"}}]})

    body = {"model": "big", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}
    config = {
        "fallback": [{"model": "big", "then": ["small"]}],
        "requests": {"context": {"big": 100_000, "small": 1_000}},
    }
    async with gateway_over(serve, {"/v1/chat/completions": node}, **config) as (_, http):
        got = await http.post("/v1/chat/completions", json=body)
        assert got.status_code == 503 and got.json()["error"]["message"] == "down"
        assert set(asked) == {"big"}  # big's own 503, as the final hop's: small never asked
        fits = await http.post("/v1/chat/completions", json={**body, "max_tokens": 500})
        assert fits.status_code == 200 and fits.headers["x-promptlb-degraded"] == "fallback"
        # Asked by the field a node reads first: small "fitted" max_tokens and answered 400.
        both = {**body, "max_tokens": 100, "max_completion_tokens": 5000}
        assert (await http.post("/v1/chat/completions", json=both)).status_code == 503


def fallback_counts(app: PromptLBMiddleware) -> dict[tuple[str, str], float]:
    """``promptlb_fallbacks_total`` by (model, to)."""
    return {
        (s.labels["model"], s.labels["to"]): s.value
        for family in app.balancer.metrics.fallbacks.collect()
        for s in family.samples
        if s.name.endswith("_total")
    }


async def test_a_fallback_is_counted_to_the_hop_that_was_tried(serve: Serve) -> None:
    """big -> small -> tiny, small too short for the answer: the fallback metric counted
    big -> small, a hop skipped, and never big -> tiny, which answered."""
    from aiohttp import web

    async def node(request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        if model == "big":
            return web.json_response({"error": {"message": "down"}}, status=503)
        return web.json_response({"choices": [{"message": {"content": f"from {model}"}}]})

    body = {"model": "big", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}
    config = {
        "fallback": [{"model": "big", "then": ["small", "tiny"]}],
        "requests": {"context": {"small": 1_000, "tiny": 10_000}},
    }
    async with gateway_over(serve, {"/v1/chat/completions": node}, **config) as (app, http):
        got = await http.post("/v1/chat/completions", json=body)
        assert got.json()["choices"][0]["message"]["content"] == "from tiny"
        counts = fallback_counts(app)
    assert counts == {("big", "tiny"): 1.0}


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [
        # The cache asked and empty, then small: both counted (small was not).
        (0, {("big", "cache"): 1.0, ("big", "small"): 1.0}),
        # A sampled answer may not stand in (degraded_sampled off): the cache hop is passed
        # over, and was counted as gone on to all the same.
        (1.0, {("big", "small"): 1.0}),
    ],
)
async def test_a_fallback_through_the_cache_hop_is_counted_as_it_went(
    serve: Serve, temperature: float, expected: dict[tuple[str, str], float]
) -> None:
    from aiohttp import web

    async def node(request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        if model == "big":
            return web.json_response({"error": {"message": "down"}}, status=503)
        return web.json_response({"choices": [{"message": {"content": f"from {model}"}}]})

    body = {"model": "big", "messages": [{"role": "user", "content": "x"}]}
    config = {
        "fallback": [{"model": "big", "then": ["cache", "small"]}],
        "cache": {"degraded_sampled": False},
    }
    async with gateway_over(serve, {"/v1/chat/completions": node}, **config) as (app, http):
        got = await http.post("/v1/chat/completions", json={**body, "temperature": temperature})
        assert got.json()["choices"][0]["message"]["content"] == "from small"
        counts = fallback_counts(app)
    assert counts == expected


async def test_the_cache_hop_after_a_final_refusal_is_counted_as_after_a_failure(
    serve: Serve,
) -> None:
    """big -> small -> cache, both models down: small's 503 asks the cache as a failure
    would, and only the failure counted it."""
    from aiohttp import web

    async def node(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "down"}}, status=503)

    body = {"model": "big", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    config = {"fallback": [{"model": "big", "then": ["small", "cache"]}], "cache": {}}
    async with gateway_over(serve, {"/v1/chat/completions": node}, **config) as (app, http):
        got = await http.post("/v1/chat/completions", json=body)
        assert got.status_code == 503  # no stored answer: small's own refusal goes on
        counts = fallback_counts(app)
    assert counts == {("big", "small"): 1.0, ("big", "cache"): 1.0}


async def test_a_model_named_cache_is_a_model_with_a_cache_configured(serve: Serve) -> None:
    # Its own name read as the chain's cache hop: never sent to its node, a 503 "no answer".
    from aiohttp import web

    async def node(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"message": {"content": "from the node"}}]})

    body = {"model": "cache", "messages": [{"role": "user", "content": "x"}]}
    async with gateway_over(serve, {"/v1/chat/completions": node}, cache={}) as (_, http):
        got = await http.post("/v1/chat/completions", json=body)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"]["content"] == "from the node"


async def test_a_reload_keeps_a_memory_cache_through_changes_it_does_not_read() -> None:
    # Redis's timeout and key prefix are nothing to a memory store: a reload changing one
    # replaced it, and every answer an outage would fall back on went with it.
    def dispatcher(previous: Dispatcher | None, **cache: object) -> Dispatcher:
        config = load_config(
            {"nodes": [{"name": "a", "url": "http://127.0.0.1:9"}], "cache": cache}
        )
        return Dispatcher(Balancer(config), previous=previous)

    first = dispatcher(None)
    kept = dispatcher(first, timeout="2s", key_prefix="other:")
    assert kept.cache is first.cache and not kept.retired
    grown = dispatcher(kept, max_bytes=200_000_000)  # what a memory store is built from
    assert grown.cache is not first.cache and grown.retired == [first.cache]
    await grown.stop()


async def test_a_chain_ending_in_the_cache_passes_the_nodes_refusal_on_when_it_has_none(
    serve: Serve,
) -> None:
    """``then = ["cache"]``: the cache is asked for the node's 429, and on a miss the 429
    goes on as it came (its Retry-After), as with [cache] alone; it became the gateway's 503.
    A stored answer stands in for it, marked."""
    from aiohttp import web

    up = {"now": True}

    async def node(request: web.Request) -> web.Response:
        if up["now"]:
            return web.json_response({"choices": [{"message": {"content": "stored"}}]})
        return web.json_response(
            {"error": {"message": "slow down"}}, status=429, headers={"Retry-After": "30"}
        )

    config = {"fallback": [{"model": "m", "then": ["cache"]}], "cache": {}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    async with gateway_over(serve, {"/v1/chat/completions": node}, **config) as (_, http):
        up["now"] = False
        got = await http.post("/v1/chat/completions", json=body)
        assert (got.status_code, got.headers.get("retry-after")) == (429, "30"), got.text
        up["now"] = True
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        await asyncio.sleep(0.1)  # the store is written in the background
        up["now"] = False
        got = await http.post("/v1/chat/completions", json=body)
        assert (got.status_code, got.headers["x-promptlb-degraded"]) == (200, "cache")


async def test_a_fallbacks_answer_leaves_the_primarys_stored_one_in_one_family(
    serve: Serve,
) -> None:
    """Stored under the family's shared key, small's fallback answer replaced big's own, so an
    outage of both served small's where big's had been kept."""
    from aiohttp import web

    up = {"big": True, "small": True}

    async def node(request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        if not up[model]:
            return web.json_response({"error": {"message": "down"}}, status=503)
        return web.json_response({"choices": [{"message": {"content": f"from {model}"}}]})

    body = {"model": "big", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    config = {
        "fallback": [{"model": "big", "then": ["small"]}],
        "cache": {"families": {"big": "llama", "small": "llama"}},
    }
    async with gateway_over(serve, {"/v1/chat/completions": node}, **config) as (_, http):

        async def ask() -> httpx.Response:
            got = await http.post("/v1/chat/completions", json=body)
            await asyncio.sleep(0.1)  # the store is written in the background
            return got

        assert (await ask()).json()["choices"][0]["message"]["content"] == "from big"
        up["big"] = False
        assert (await ask()).headers["x-promptlb-degraded"] == "fallback"
        up["small"] = False
        got = await ask()
        assert got.headers["x-promptlb-degraded"] == "cache"
        assert got.json()["choices"][0]["message"]["content"] == "from big"


async def test_a_full_admission_queue_degrades_to_the_chain_at_once(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    """No room to wait (``queue_size = 0``) is what a wait's end is: the chain's next model,
    at once. It used to be a 429 just when the lighter model should have served it."""
    config = (
        "[[fallback]]\nmodel = 'big'\nthen = ['small']\n"
        "[shedding]\nenabled = true\nmax_in_flight = 1\nqueue_size = 0\nqueue_timeout = '5s'\n"
    )
    c = cluster(
        {
            "big": ("--model", "big", "--ttft-ms", "100", "--tokens-per-s", "10"),
            "small": ("--model", "small", *fast),
        },
        config,
    )
    body = {"model": "big", "messages": hello, "max_tokens": 20, "temperature": 0}
    busy = asyncio.ensure_future(post(c.app.url, body))  # ~2 s on big: big is at its cap

    async def at_cap() -> bool:  # (a fixed sleep raced the first request's getting there)
        return any(n["in_flight"] for n in (await c.status())["nodes"] if n["name"] == "big")

    await eventually(at_cap)
    code, headers, _, elapsed = await post(c.app.url, {**body, "max_tokens": 2})
    assert code == 200 and elapsed < 1.0, (code, elapsed)
    assert (headers["x-promptlb-model"], headers["x-promptlb-degraded"]) == ("small", "fallback")
    assert (await busy)[0] == 200
    # Counted as a fallback: the dashboard and the degraded-answers panel stayed flat.
    async with aiohttp.ClientSession() as http, http.get(c.app.url + "/_promptlb/metrics") as r:
        assert 'promptlb_fallbacks_total{model="big",to="small"} 1.0' in await r.text()


async def test_shed_with_only_the_cache_after_the_primary_and_nothing_stored_is_a_429(
    serve: Serve,
) -> None:
    """A chain of ``["cache"]`` with nothing stored turned a queue's refusal into a 503 with the
    health interval's Retry-After, where a chain-less model answers 429 with shedding's."""
    from aiohttp import web

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(0.5)
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    config = {
        "fallback": [{"model": "m", "then": ["cache"]}],
        "cache": {},
        "shedding": {"enabled": True, "max_in_flight": 1, "queue_size": 0, "retry_after": 3},
    }
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    async with gateway_over(serve, {"/v1/chat/completions": slow}, **config) as (_, http):
        busy = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
        await asyncio.sleep(0.1)
        other = {**body, "messages": [{"role": "user", "content": "never stored"}]}
        got = await http.post("/v1/chat/completions", json=other)
        assert (got.status_code, got.headers["retry-after"]) == (429, "3")
        assert (await busy).status_code == 200


async def test_cache_lookups_are_counted_as_the_client_got_them(serve: Serve) -> None:
    """A fresh lookup that finds nothing is a miss (it was not counted at all); a stored answer
    a streaming client cannot take (one that does not replay as a stream) is no hit, where it
    was counted a stale hit before the 503."""
    from aiohttp import web

    up = {"now": True}

    async def node(request: web.Request) -> web.Response:
        if up["now"]:
            return web.json_response({"object": "list", "data": [], "model": "m"})
        return web.json_response({"error": {"message": "down"}}, status=503)

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    routes = {"/v1/chat/completions": node}
    async with gateway_over(serve, routes, cache={"serve_fresh": True}) as (app, http):
        count = app.balancer.metrics.registry.get_sample_value

        def seen(result: str) -> float:
            return count("promptlb_cache_lookups_total", {"result": result}) or 0.0

        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        assert (seen("miss"), seen("fresh_hit")) == (1, 0)
        await asyncio.sleep(0.1)  # the store is written in the background
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        assert (seen("miss"), seen("fresh_hit")) == (1, 1)
        up["now"] = False  # the node answers 503; its stored answer has no choices
        got = await http.post("/v1/chat/completions", json={**body, "stream": True})
        assert got.status_code == 503
        assert seen("stale_hit") == 0


async def test_an_attempt_answered_before_its_hedge_was_due_wins_no_race() -> None:
    # won_first counted every hedged chain's answer, hedged or not: with 1% of requests
    # hedged, won_first + won_hedge came to a hundred times the hedges sent.
    lb = Balancer(Config(nodes=(NodeConfig(name="a", url="http://127.0.0.1:9"),)))

    async def answer() -> Answer:
        return Answer("m")

    alone = asyncio.ensure_future(answer())
    assert await _first_success([alone], lb) is alone
    raced = [asyncio.ensure_future(answer()), asyncio.ensure_future(answer())]
    assert await _first_success(raced, lb) is raced[0]
    count = lb.metrics.registry.get_sample_value
    assert count("promptlb_hedges_total", {"event": "won_first"}) == 1
    assert count("promptlb_hedges_total", {"event": "won_hedge"}) is None


@pytest.mark.parametrize("hedge", ["answers", "fails", "refuses too"])
async def test_a_nodes_own_refusal_wins_a_race_only_once_nothing_better_can_come(
    hedge: str,
) -> None:
    """A final hop passes a node's 503 on rather than fail: raced by a hedge, the first try's
    quick 503 won and cancelled the hedge 0.1 s from its 200 (which, unhedged, a retry would
    have reached). It waits for the hedge now, and is charged to its node as a 503 when the
    hedge wins; passed on (its tries with the hedge's) when the hedge fails too."""
    lb = Balancer(Config(nodes=(NodeConfig(name="a", url="http://127.0.0.1:9"),)))
    settled: list[BaseException | None] = []

    class Held:
        def close(self, exc: BaseException | None = None) -> None:
            settled.append(exc)

    def refusal(code: int) -> Answer:
        up = SimpleNamespace(response=SimpleNamespace(status=code), node=SimpleNamespace(name="a"))
        return Answer("m", upstream=cast(Upstream, up), held=cast(Try, Held()), attempts=1)

    async def first() -> Answer:
        await asyncio.sleep(0.01)
        return refusal(503)

    async def second() -> Answer:
        await asyncio.sleep(0.05)
        if hedge == "fails":
            raise UpstreamError(502, "broke", 2)
        return refusal(429) if hedge == "refuses too" else Answer("m", attempts=1)

    raced = [asyncio.ensure_future(first()), asyncio.ensure_future(second())]
    won = await _first_success(raced, lb)
    count = lb.metrics.registry.get_sample_value
    if hedge == "answers":
        assert won is raced[1] and won.result().attempts == 2  # the 503's try counted too
        assert count("promptlb_hedges_total", {"event": "won_hedge"}) == 1
        (charged,) = settled
        assert isinstance(charged, UpstreamError) and charged.status == 503
    else:
        assert won is raced[0] and won.result().attempts == (3 if hedge == "fails" else 2)
        assert count("promptlb_hedges_total", {"event": "won_first"}) is None
        assert len(settled) == (1 if hedge == "refuses too" else 0)  # the 429 is charged


def test_a_reload_that_changes_only_how_answers_are_served_keeps_the_stored_ones() -> None:
    # Any [cache] change replaced the store: a memory backend lost every answer, which is
    # what an outage falls back on.
    def live(cache: dict[str, Any], before: Any = None) -> Any:
        nodes = [{"name": "a", "url": "http://127.0.0.1:9"}]
        return build_live(load_config({"nodes": nodes, "cache": cache}), before)

    first = live({"serve_fresh": False})
    second = live({"serve_fresh": True, "ttl": "10m", "cache_sampled": True}, first)
    assert second.dispatcher.cache is first.dispatcher.cache
    assert not second.dispatcher.retired
    third = live({"serve_fresh": True, "ttl": "10m", "max_bytes": 2**20}, second)
    assert third.dispatcher.cache is not second.dispatcher.cache
    assert third.dispatcher.retired == [second.dispatcher.cache]


async def test_an_answer_judged_the_requests_fault_is_not_opened_again_when_it_breaks() -> None:
    # Two nodes failed the request alike (a poison prompt): no third try. Its answer breaking
    # off before the first byte must not bring one back.
    from promptlb.middleware._degrade import Dispatcher

    nodes = tuple(NodeConfig(name=n, url="http://127.0.0.1:1", models=("m",)) for n in "abc")
    lb = Balancer(Config(nodes=nodes, health=HealthConfig(enabled=False)))
    dispatcher = Dispatcher(lb)
    loop = asyncio.get_running_loop()
    up = SimpleNamespace(attempts=2, request_fault=False, deadline=loop.time() + 30)
    try:
        assert dispatcher._retry("m", cast(Any, up), {"a", "b"})  # c is left, tries too
        up.request_fault = True
        assert not dispatcher._retry("m", cast(Any, up), {"a", "b"})
        up.request_fault, up.attempts = False, 3
        assert not dispatcher._retry("m", cast(Any, up), {"a", "b"})  # attempts spent
        up.attempts, up.deadline = 1, loop.time() - 1
        assert not dispatcher._retry("m", cast(Any, up), {"a"})  # no time left
    finally:
        await lb.stop()
