"""The live runner's prefix-cache readings, from a real emulator."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from unittest import mock

import aiohttp
from aiohttp import web
from promptlb.bench import _livecache
from promptlb.bench._live import start_gateway, wait_ready
from promptlb.bench._livecache import share_lag, watch_kv
from promptlb.bench._loadgen import replay
from promptlb.bench._scenario import Arrival, load_scenario

from tests.bench.conftest import running_cluster
from tests.conftest import Launcher, Serve, need_binary


async def test_how_full_each_nodes_kv_cache_is_is_read_over_the_run(launch: Launcher) -> None:
    node = launch("emulator", "--ttft-ms", "0", "--kv-blocks", "100")
    started = time.monotonic()
    readings: dict[str, list[list[float]]] = {}
    async with aiohttp.ClientSession() as http:
        watching = asyncio.create_task(
            watch_kv(http, {"a": node.url}, lambda: time.monotonic() - started, readings)
        )
        await asyncio.sleep(0.3)
        body = {"messages": [{"role": "user", "content": "x" * 3200}], "max_tokens": 1}
        async with http.post(node.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
        await asyncio.sleep(1.2)  # the next reading
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    points = readings["a"]
    assert len(points) >= 2 and points[0] == [0.0, 0.0]
    assert 0.1 < points[-1][1] <= 1.0  # ~800 tokens of 1,600 held, cached after the answer
    assert all(b[0] > a[0] for a, b in itertools.pairwise(points))


async def test_a_reading_of_another_shape_is_left_out_and_the_watch_goes_on(
    serve: Serve,
) -> None:
    # A 200 of another shape raised TypeError, which ended the watch and, re-raised where the
    # run's end awaits it, threw the finished replay away.
    answers = iter([[], {"kv_filled": None}])

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(next(answers, {"kv_filled": 0.5}))

    app = web.Application()
    app.router.add_get("/_emulator/stats", stats)
    readings: dict[str, list[list[float]]] = {}
    async with serve(app) as url, aiohttp.ClientSession() as http:
        with mock.patch.object(_livecache, "KV_POLL_S", 0.05):
            watching = asyncio.create_task(watch_kv(http, {"a": url}, lambda: 0.0, readings))
            await asyncio.sleep(0.5)
        assert not watching.done()
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    assert readings["a"] and all(point == [0.0, 0.5] for point in readings["a"])


def _left(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.suffix != ".toml"]


async def test_a_shared_run_is_replicas_on_one_redis_taking_the_load_in_turn(
    tmp_path: Path,
) -> None:
    """``predictive+shared`` live: two gateways sharing through a Redis of their own, the
    trace's requests alternating between them, and every process gone once it stops."""
    need_binary("redis-server", "redis-server")
    scenario = (
        'duration = "3s"\nseed = 3\n[workload.prompts]\nkind = "chat"\ntenants = 2\n'
        "users = 2\nsystem_tokens = 600\n"
        '[[nodes]]\nname = "n"\ncount = 2\nttft_ms = 5\ntokens_per_s = 2000\n'
    )
    with running_cluster(tmp_path / "two.toml", scenario) as cluster:
        target = start_gateway("predictive+shared", cluster, tmp_path, replicas=2)
        try:
            text = (tmp_path / "gateway-predictive+shared.toml").read_text(encoding="utf-8")
            assert "[index_share]" in text and "strategy = 'predictive'" in text
            assert len(target.urls) == 2 and target.url == target.urls[0]
            async with aiohttp.ClientSession() as http:
                await wait_ready(http, target, len(cluster.nodes))
                trace = [Arrival(0.05 * i, "chat", 50, 4) for i in range(6)]
                results = await replay(target.urls, trace, model=cluster.scenario.model)
                assert not any(r.error for r in results), results
                served = []
                for url in target.urls:
                    async with http.get(url + "/_promptlb/status") as response:
                        status = await response.json()
                    served.append(sum(n["requests"] for n in status["nodes"]))
                await asyncio.sleep(0.2)  # rounds of 20 ms: each learns the other's records
                each = [await share_lag(http, [url]) for url in target.urls]
                lag = await share_lag(http, target.urls)
            assert served == [3, 3]
            # Each replica learnt the other's entries, within seconds (the same host's clock
            # on both sides of the lag), and the run's figure sums the two.
            counts = [one["entries"] if one is not None else 0 for one in each]
            assert all(count >= 1 for count in counts), each
            assert lag is not None and lag["entries"] == sum(counts), (lag, each)
            assert lag["within_s"]["5"] == 1.0 and next(iter(lag["within_s"])) == "0.005", lag
        finally:
            target.stop()
        assert _left(tmp_path) == []  # the Redis persisted nothing
    assert all(s.proc.poll() is not None for s in cluster.services)


def test_runs_start_on_cold_caches_wherever_a_cache_changes_a_requests_time() -> None:
    """mixed-class has no prompts but prefill rates: its filler prompts repeat run for run,
    and each run found the one before's tail cached."""
    assert _livecache.starts_cold(True, [0.0])
    assert _livecache.starts_cold(False, [0.0, 8000.0])
    assert not _livecache.starts_cold(False, [0.0, 0.0])
    mixed = load_scenario("mixed-class")
    assert _livecache.starts_cold(False, (n.prefill_tokens_per_s for n in mixed.nodes))
