"""The live runner's prefix-cache readings, from a real emulator."""

from __future__ import annotations

import asyncio
import itertools
import time

import aiohttp
from promptlb.bench._livecache import watch_kv

from tests.conftest import Launcher


async def test_kv_use_is_read_off_each_nodes_gauge_over_the_run(launch: Launcher) -> None:
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
