"""Many concurrent streams on one emulator process: all finish, on at most one core."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import aiohttp
import psutil

if TYPE_CHECKING:
    from tests.emulator.conftest import StartEmulator

STREAMS = 500
MAX_TOKENS = 20
TOKENS_PER_S = 20
TTFT_MS = 50


async def _one_stream(session: aiohttp.ClientSession, url: str, i: int) -> int:
    """Stream one chat completion; the number of content words, checked to end with [DONE]."""
    body = {
        "messages": [{"role": "user", "content": f"stream {i}"}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    words = 0
    last = ""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            last = line.removeprefix("data: ")
            if last != "[DONE]":
                delta = json.loads(last)["choices"][0]["delta"]
                words += len(delta.get("content", "").split())
    assert last == "[DONE]"
    return words


async def test_500_concurrent_streams_all_complete(start_emulator: StartEmulator) -> None:
    emu = start_emulator(
        "--slots",
        str(STREAMS),
        "--tokens-per-s",
        str(TOKENS_PER_S),
        "--ttft-ms",
        str(TTFT_MS),
    )
    proc = psutil.Process(emu.pid)
    url = f"{emu.url}/v1/chat/completions"
    per_stream_s = TTFT_MS / 1000 + MAX_TOKENS / TOKENS_PER_S  # 1.05 s
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        cpu_before = proc.cpu_times()
        start = time.monotonic()
        words = await asyncio.wait_for(
            asyncio.gather(*(_one_stream(session, url, i) for i in range(STREAMS))), 90
        )
        wall = time.monotonic() - start
        cpu_after = proc.cpu_times()
    cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    print(f"\n{STREAMS} streams: wall {wall:.2f} s, emulator CPU {cpu:.2f} s")
    assert words == [MAX_TOKENS] * STREAMS
    assert wall >= per_stream_s * 0.95
    assert cpu < wall, f"emulator used {cpu:.2f} s CPU in {wall:.2f} s: more than one core"
