"""Config reload without a restart: `PromptLBMiddleware.reload` in process against real
emulator processes, and SIGHUP to a real ``promptlb-gateway``."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from promptlb.emulator import Service, start_command
from promptlb.middleware import PromptLBMiddleware
from promptlb.middleware._cache import CacheEntry, MemoryCache
from promptlb.middleware._config import load_config
from promptlb.middleware._live import describe
from promptlb.middleware._predictive import Predictive

from tests.conftest import Launcher, Serve

FAST = ("--model", "m", "--ttft-ms", "5", "--tokens-per-s", "2000")
BASE = """
strategy = "weighted"
slow_start = "0s"
admin_local_only = true
health = { interval = "200ms", timeout = "500ms" }
"""
ASK = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def nodes_toml(*nodes: tuple[str, Service, float], model: str = "m") -> str:
    return "".join(
        f"[[nodes]]\nname = '{name}'\nurl = '{svc.url}'\nweight = {weight}\nmodels = ['{model}']\n"
        for name, svc, weight in nodes
    )


def mounted(path: Path, text: str) -> PromptLBMiddleware:
    """The middleware (with no app behind it) on the config ``text``, written to ``path``."""
    path.write_text(text)
    return PromptLBMiddleware(None, config=path)  # type: ignore[arg-type]


async def drain(app: PromptLBMiddleware) -> None:
    await app.dispatcher.stop()


def client(app: PromptLBMiddleware) -> httpx.AsyncClient:
    # The "client" address is loopback, so admin_local_only opens the status page.
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
    return httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30)


async def placed(http: httpx.AsyncClient, n: int, body: dict[str, Any] = ASK) -> Counter[str]:
    seen: Counter[str] = Counter()
    for _ in range(n):
        answer = await http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        seen[answer.headers["x-promptlb-node"]] += 1
    return seen


async def test_reload_adds_and_removes_nodes_and_changes_weights(
    launch: Launcher, tmp_path: Path
) -> None:
    a, b = launch("emulator", *FAST), launch("emulator", *FAST)
    path = tmp_path / "promptlb.toml"
    app = mounted(path, BASE + nodes_toml(("a", a, 1)))
    async with client(app) as http:
        assert await placed(http, 4) == {"a": 4}
        strategy = app.balancer.strategy
        path.write_text(BASE + nodes_toml(("a", a, 1), ("b", b, 3)))
        assert await app.reload()
        # b was checked before the reload returned: it takes its weighted share at once.
        assert await placed(http, 40) == {"a": 10, "b": 30}
        # The strategy's settings did not change: the object (and what it learnt) stays.
        assert app.balancer.strategy is strategy
        path.write_text(BASE + nodes_toml(("b", b, 1)))
        assert await app.reload()
        assert await placed(http, 5) == {"b": 5}
        status = (await http.get("/_promptlb/status")).json()
        assert [n["name"] for n in status["nodes"]] == ["b"]
        assert status["nodes"][0]["weight"] == 1
    await drain(app)


async def test_requests_under_way_finish_where_they_started(
    launch: Launcher, tmp_path: Path
) -> None:
    slow = launch("emulator", "--model", "m", "--ttft-ms", "5", "--tokens-per-s", "40")
    b = launch("emulator", *FAST)
    path = tmp_path / "promptlb.toml"
    app = mounted(path, BASE + nodes_toml(("a", slow, 1)))
    async with client(app) as http:
        await placed(http, 1)
        long = {**ASK, "max_tokens": 60, "stream": True}  # 1.5 s at 40 tokens/s
        under_way = asyncio.create_task(http.post("/v1/chat/completions", json=long))
        await asyncio.sleep(0.3)
        assert app.balancer.table.nodes["a"].view.in_flight == 1
        path.write_text(BASE + nodes_toml(("b", b, 1)))
        assert await app.reload()
        assert set(app.balancer.table.nodes) == {"b"}
        assert await placed(http, 3) == {"b": 3}  # new requests: the new config
        answer = await under_way
        assert answer.status_code == 200
        assert answer.headers["x-promptlb-node"] == "a"
        assert answer.text.rstrip().endswith("data: [DONE]")  # the whole stream, from a
    await drain(app)


@pytest.mark.parametrize(
    ("bad", "key"),
    [
        ("[retry]\nattempts = 99\n", "retry.attempts"),
        # Only the strategy can tell: checked when the balancer is built, still refused whole.
        ("strategy_options = { sample = -1 }\n", "strategy_options.sample"),
        ("[cache\nbackend = 'memory'\n", "config"),  # not TOML at all
        ("[[nodes]]\nname = 'c'\nurl = 'ftp://x'\n", "nodes[0].url"),
    ],
)
async def test_a_config_that_does_not_validate_is_refused_and_the_old_one_stays(
    launch: Launcher, tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: str, key: str
) -> None:
    a, b = launch("emulator", *FAST), launch("emulator", *FAST)
    path = tmp_path / "promptlb.toml"
    app = mounted(path, BASE + nodes_toml(("a", a, 1)))
    async with client(app) as http:
        await placed(http, 1)
        before = app.config
        # The refused file also adds node b: none of it may take effect.
        path.write_text(BASE + bad + nodes_toml(("a", a, 1), ("b", b, 1)))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="promptlb"):
            assert not await app.reload()
        lines = [r for r in caplog.records if r.name.startswith("promptlb")]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert lines[0].levelno == logging.ERROR
        assert "reload refused" in lines[0].getMessage()
        assert key in lines[0].getMessage()
        assert app.config is before
        assert set(app.balancer.table.nodes) == {"a"}
        assert await placed(http, 3) == {"a": 3}
    await drain(app)


async def test_reload_changes_fallback_cache_and_shedding(launch: Launcher, tmp_path: Path) -> None:
    big = launch("emulator", "--model", "big", "--ttft-ms", "5", "--tokens-per-s", "20")
    small = launch("emulator", "--model", "small", "--ttft-ms", "5", "--tokens-per-s", "2000")
    nodes = nodes_toml(("big-1", big, 1), model="big") + nodes_toml(
        ("small-1", small, 1), model="small"
    )
    path = tmp_path / "promptlb.toml"
    app = mounted(path, BASE + nodes)
    ask_big = {**ASK, "model": "big", "max_tokens": 40, "temperature": 0}  # 2 s at 20 tokens/s
    async with client(app) as http:
        first = await http.post("/v1/chat/completions", json=ask_big)
        assert first.headers["x-promptlb-node"] == "big-1"
        # Before: no chain, no cache, no shedding. A sheddable request beside one under way
        # goes through.
        under_way = asyncio.create_task(http.post("/v1/chat/completions", json=ask_big))
        await asyncio.sleep(0.2)
        sheddable = {"x-promptlb-priority": "sheddable"}
        assert (
            await http.post("/v1/chat/completions", json=ask_big, headers=sheddable)
        ).status_code == 200
        await under_way
        path.write_text(
            BASE
            + "[[fallback]]\nmodel = 'big'\nthen = ['small']\nttft = '10s'\n"
            + "[cache]\nbackend = 'memory'\nserve_fresh = true\n"
            + "[shedding]\nenabled = true\nmax_in_flight = 1\n"
            + nodes
        )
        assert await app.reload()
        # The cache is new: the first answer is stored, the same question again comes from it.
        stored = await http.post("/v1/chat/completions", json=ask_big)
        assert stored.headers["x-promptlb-node"] == "big-1"
        for _ in range(50):
            again = await http.post("/v1/chat/completions", json=ask_big)
            if again.headers.get("x-promptlb-cache") == "hit":
                break
            await asyncio.sleep(0.05)  # the write is in the background
        assert again.headers.get("x-promptlb-cache") == "hit"
        # Shedding: with one request open on big-1 the pool is saturated; sheddable gets 429.
        other = {**ask_big, "messages": [{"role": "user", "content": "something else"}]}
        under_way = asyncio.create_task(http.post("/v1/chat/completions", json=other))
        await asyncio.sleep(0.2)
        shed = await http.post(
            "/v1/chat/completions",
            json={**other, "max_tokens": 3},
            headers=sheddable,
        )
        assert shed.status_code == 429
        await under_way
        # The fallback chain: big's node gone, big is answered by small.
        big.proc.kill()
        big.proc.wait(timeout=5)
        fallen = await http.post(
            "/v1/chat/completions",
            json={**ask_big, "messages": [{"role": "user", "content": "a third"}]},
        )
        assert fallen.status_code == 200, fallen.text
        assert fallen.headers["x-promptlb-degraded"] == "fallback"
        assert fallen.headers["x-promptlb-model"] == "small"
    await drain(app)


async def test_reload_changes_strategy_and_its_options(launch: Launcher, tmp_path: Path) -> None:
    a = launch("emulator", *FAST)
    path = tmp_path / "promptlb.toml"
    app = mounted(path, BASE + nodes_toml(("a", a, 1)))
    async with client(app) as http:
        await placed(http, 2)
        path.write_text(
            BASE.replace('"weighted"', '"least_conn"')
            + "strategy_options = { sample = 5 }\n"
            + nodes_toml(("a", a, 1))
        )
        assert await app.reload()
        assert app.balancer.strategy.name == "least_conn"
        assert getattr(app.balancer.strategy, "sample", None) == 5
        await placed(http, 2)
        metrics = (await http.get("/_promptlb/metrics")).text
        assert 'promptlb_picks_total{node="a",strategy="least_conn"} 2.0' in metrics
        assert 'promptlb_picks_total{node="a",strategy="weighted"} 2.0' in metrics
        # A Config object (or mapping) can be handed in directly, too.
        assert await app.reload({"nodes": [{"name": "a", "url": a.url, "models": ["m"]}]})
        assert app.config.strategy == "predictive"
        assert await placed(http, 1) == {"a": 1}
    await drain(app)


async def test_sighup_reloads_a_running_gateway(launch: Launcher, tmp_path: Path) -> None:
    a, b = launch("emulator", *FAST), launch("emulator", *FAST)
    path = tmp_path / "promptlb.toml"
    path.write_text(BASE + nodes_toml(("a", a, 1)))
    gateway = start_command(
        "gateway", ["-m", "promptlb.middleware", "--config", str(path), "--port", "0"]
    )
    try:
        async with aiohttp.ClientSession() as http:

            async def node_of() -> str:
                url = gateway.url + "/v1/chat/completions"
                async with http.post(url, json=ASK) as answer:
                    assert answer.status == 200
                    return answer.headers["x-promptlb-node"]

            assert await node_of() == "a"
            path.write_text(BASE + nodes_toml(("b", b, 1)))
            gateway.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while await node_of() != "b":
                assert time.monotonic() < deadline, gateway.log()
                await asyncio.sleep(0.1)
            assert "config reloaded: nodes added b; nodes removed a" in gateway.log()
            # A bad file: refused in one line naming the key; b keeps serving.
            path.write_text(BASE + "[retry]\nattempts = 0\n" + nodes_toml(("a", a, 1)))
            gateway.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while "reload refused" not in gateway.log():
                assert time.monotonic() < deadline, gateway.log()
                await asyncio.sleep(0.1)
            refused = [line for line in gateway.log().splitlines() if "reload refused" in line]
            assert len(refused) == 1 and "retry.attempts" in refused[0]
            assert [await node_of() for _ in range(3)] == ["b"] * 3
            assert gateway.proc.poll() is None  # still up
    finally:
        gateway.stop()


async def test_a_name_pointed_at_another_server_starts_without_what_was_learnt_of_the_old(
    launch: Launcher, tmp_path: Path
) -> None:
    """predictive learns each node's speed and where prompts went; re-pointing a name at
    another server must not hand that to it (nor keep a removed node's)."""
    a, b, c = (launch("emulator", *FAST) for _ in range(3))
    path = tmp_path / "promptlb.toml"
    base = BASE.replace('"weighted"', '"predictive"')
    app = mounted(path, base + nodes_toml(("a", a, 1), ("b", b, 1)))
    # Long enough for the index to hold its head (a coarse block is 256 tokens).
    long = {**ASK, "messages": [{"role": "user", "content": "a long question " * 200}]}
    async with client(app) as http:
        await placed(http, 12, long)
        strategy = app.balancer.strategy
        assert isinstance(strategy, Predictive) and strategy.index is not None
        learnt = {n for n in ("a", "b") if strategy.model_of(n) is not None}
        held = set(strategy.index._nodes)
        assert learnt == held == {"a", "b"}
        path.write_text(base + nodes_toml(("a", c, 1)))  # "a" is now c; b is gone
        assert await app.reload()
        assert app.balancer.strategy is strategy  # same settings: the strategy stays
        assert strategy.model_of("a") is None and strategy.model_of("b") is None
        assert not strategy.index._nodes
        await placed(http, 3)  # the new "a" is learnt afresh
        model = strategy.model_of("a")
        assert model is not None and model.count <= 3
        metrics = app.balancer.metrics.render().decode()
    # b's series went with it; a's count only what the new server answered
    assert 'node="b"' not in metrics
    assert 'promptlb_requests_total{node="a",outcome="200"} 3.0' in metrics
    await drain(app)


async def test_an_answer_that_ends_after_its_node_was_replaced_teaches_nothing(
    launch: Launcher, tmp_path: Path
) -> None:
    """A stream still open on the old server when a reload re-pointed its name ended and
    taught predictive, bringing back the old server's speed under the new server's name."""
    slow = launch("emulator", "--model", "m", "--ttft-ms", "5", "--tokens-per-s", "20")
    other = launch("emulator", *FAST)
    path = tmp_path / "promptlb.toml"
    base = BASE.replace('"weighted"', '"predictive"')
    app = mounted(path, base + nodes_toml(("a", slow, 1)))
    async with client(app) as http:
        await placed(http, 2)
        under_way = asyncio.create_task(
            http.post("/v1/chat/completions", json={**ASK, "max_tokens": 20})  # ~1 s
        )
        await asyncio.sleep(0.3)
        path.write_text(base + nodes_toml(("a", other, 1)))  # "a" is now another server
        assert await app.reload()
        strategy = app.balancer.strategy
        assert isinstance(strategy, Predictive) and strategy.model_of("a") is None
        assert (await under_way).status_code == 200
        assert strategy.model_of("a") is None  # the old server's answer taught nothing
    await drain(app)


def test_the_reload_log_line_names_every_key_that_changed() -> None:
    node = {"nodes": [{"name": "a", "url": "http://a:1", "models": ["m"]}]}
    old = load_config(node)
    new = load_config({**node, "stale_after": "9s", "index_share": {"redis": "redis://r:6379"}})
    line = describe(old, new, [], [])
    assert line == "changed stale_after, index_share", line
    assert describe(old, load_config(node), [], []) == "nothing changed"


async def test_a_replaced_cache_is_closed_once_its_requests_are_over(tmp_path: Path) -> None:
    """A reload that changes [cache]'s store replaces the cache; the old one was kept until shutdown
    (each such reload held another `max_bytes`). It is now closed once the longest answer its
    config allows is over, and a late write to it keeps nothing."""
    base = (
        "[health]\nenabled = false\n[retry]\nper_try_timeout = '200ms'\ntotal_timeout = '300ms'\n"
        "[[nodes]]\nname = 'a'\nurl = 'http://127.0.0.1:9'\n"
    )
    path = tmp_path / "promptlb.toml"
    app = mounted(path, base + "[cache]\nmax_bytes = 1048576\n")
    old = app.dispatcher.cache
    assert isinstance(old, MemoryCache)
    await old.put("k", CacheEntry(b"{}", "m", time.time()))
    path.write_text(base + "[cache]\nmax_bytes = 2097152\n")
    assert await app.reload()
    assert app.dispatcher.cache is not old and app.dispatcher.retired == [old]
    assert len(old) == 1  # requests that began on it may still read it
    await asyncio.sleep(0.6)  # past the 300 ms an answer may take
    assert app.dispatcher.retired == [] and len(old) == 0
    await old.put("late", CacheEntry(b"{}", "m", time.time()))
    assert len(old) == 0
    path.write_text(base + "[cache]\nmax_bytes = 4194304\n")
    assert await app.reload()  # one replaced just before shutdown is closed by it
    replaced = app.dispatcher.retired[0]
    assert isinstance(replaced, MemoryCache) and len(replaced) == 0  # nothing put in it
    await replaced.put("k", CacheEntry(b"{}", "m", time.time()))
    await drain(app)
    assert app.dispatcher.retired == [] and len(replaced) == 0


async def test_a_balancer_a_reload_superseded_before_it_started_runs_no_loops_of_its_own(
    tmp_path: Path,
) -> None:
    # No lifespan and no request yet, so nothing started; a reload, then a request that was
    # still on the old config (the in-app client's, say) starts the old balancer.
    node = "[[nodes]]\nname = 'a'\nurl = 'http://127.0.0.1:9'\nmodels = ['m']\n"
    app = mounted(tmp_path / "promptlb.toml", BASE + node)
    old = app.balancer
    assert not old.started
    assert await app.reload(
        {"strategy": "p2c", "nodes": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}]}
    )
    new = app.balancer
    await old.start()
    try:
        assert old.started and new.started
        assert old._session is new._session
        assert old._evidence is None and old._share is None  # no loops under the old config
    finally:
        await drain(app)
    assert new._session is None


async def test_a_reload_whose_caller_is_cancelled_still_switches_whole(
    tmp_path: Path, serve: Serve
) -> None:
    # Cancelled while the new node was checked (a handler's timeout around reload()): the old
    # config stayed in force with its cache retired and its loops stopped.
    checking = asyncio.Event()
    go_on = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        checking.set()
        await go_on.wait()
        return web.json_response({"status": "ok"})

    slow = web.Application()
    slow.router.add_get("/health", health)
    node_a = "[[nodes]]\nname = 'a'\nurl = 'http://127.0.0.1:9'\nmodels = ['m']\n"
    app = mounted(tmp_path / "promptlb.toml", BASE + node_a + "[cache]\nmax_bytes = 1048576\n")
    async with serve(slow) as url:
        try:
            await app.balancer.start()
            a = {"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}
            new = {
                "nodes": [a, {"name": "b", "url": url, "models": ["m"]}],
                "cache": {"max_bytes": 2097152},
            }
            reloading = asyncio.create_task(app.reload(new))
            await checking.wait()  # the newcomer's check is under way
            reloading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reloading
            go_on.set()
            for _ in range(100):
                if "b" in {n.name for n in app.config.nodes}:
                    break
                await asyncio.sleep(0.02)
            assert {n.name for n in app.config.nodes} == {"a", "b"}  # switched, not half way
            cache = app.dispatcher.cache
            assert cache is not None and cache not in app.dispatcher.retired
            assert app.balancer._evidence is not None  # its loops run
        finally:
            go_on.set()
            await drain(app)
