"""The emulator's faults, each through a real ``promptlb-emulator`` process."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import openai
import psutil
import pytest

if TYPE_CHECKING:
    from tests.emulator.conftest import StartEmulator

TIMEOUT = aiohttp.ClientTimeout(total=30)
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
MiB = 1024 * 1024


async def _status(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with session.post(url, json=body) as resp:
        await resp.read()
        return resp.status


async def test_error_rate_one_answers_every_request_500(start_emulator: StartEmulator) -> None:
    emu = start_emulator("--error-rate", "1.0", "--ttft-ms", "0")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for path, body in [
            ("/v1/chat/completions", CHAT),
            ("/v1/chat/completions", {**CHAT, "stream": True}),
            ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
            ("/v1/embeddings", {"input": "x"}),
        ]:
            async with session.post(f"{emu.url}{path}", json=body) as resp:
                assert resp.status == 500, path
                err = (await resp.json())["error"]
            assert err["code"] == 500
            assert err["type"] == "internal_server_error"
        async with session.get(f"{emu.url}/health") as resp:
            assert resp.status == 200  # the process itself is fine

    client = openai.AsyncOpenAI(base_url=f"{emu.url}/v1", api_key="x", max_retries=0, timeout=30)
    try:
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(
                model="emulated", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
    finally:
        await client.close()


async def test_seed_makes_error_decisions_repeatable(start_emulator: StartEmulator) -> None:
    flags = ("--error-rate", "0.5", "--seed", "1234", "--ttft-ms", "0", "--tokens-per-s", "10000")
    runs: list[list[int]] = []
    for _ in range(2):
        emu = start_emulator(*flags)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            # One after the other: the decisions are drawn in arrival order.
            runs.append(
                [await _status(session, f"{emu.url}/v1/chat/completions", CHAT) for _ in range(24)]
            )
    assert runs[0] == runs[1]
    assert set(runs[0]) == {200, 500}  # 0.5 really mixes (fixed by the seed, so not flaky)


async def test_slow_factor_stretches_ttft_and_generation(start_emulator: StartEmulator) -> None:
    ttft_s, tokens_per_s, max_tokens, factor = 0.1, 20, 4, 3.0
    normal_s = ttft_s + max_tokens / tokens_per_s  # 0.3 s
    emu = start_emulator(
        "--slow-factor",
        str(factor),
        "--ttft-ms",
        str(ttft_s * 1000),
        "--tokens-per-s",
        str(tokens_per_s),
    )
    body = {**CHAT, "max_tokens": max_tokens}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for stream in (False, True):
            start = time.monotonic()
            async with session.post(
                f"{emu.url}/v1/chat/completions", json={**body, "stream": stream}
            ) as resp:
                assert resp.status == 200
                await resp.read()
            elapsed = time.monotonic() - start
            # TTFT x3 and tokens/s /3: 0.9 s, where the unslowed model takes 0.3 s.
            assert elapsed >= factor * normal_s * 0.95, (stream, elapsed)
        start = time.monotonic()
        assert await _status(session, f"{emu.url}/v1/embeddings", {"input": "x"}) == 200
        assert time.monotonic() - start >= factor * ttft_s * 0.95


async def test_hang_after_one_leaves_the_second_request_unanswered(
    start_emulator: StartEmulator,
) -> None:
    emu = start_emulator("--hang-after", "1", "--ttft-ms", "0")
    url = f"{emu.url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        assert await _status(session, url, CHAT) == 200
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(
                url, json=CHAT, timeout=aiohttp.ClientTimeout(total=1.0)
            ) as resp:
                await resp.read()
        # Hung, not dead: the process still answers what does not go through admission.
        async with session.get(f"{emu.url}/health") as resp:
            assert resp.status == 200
    assert emu.proc.poll() is None


async def test_crash_after_two_exits_on_the_third_request(start_emulator: StartEmulator) -> None:
    emu = start_emulator("--crash-after", "2", "--ttft-ms", "0")
    url = f"{emu.url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        assert await _status(session, url, CHAT) == 200
        assert await _status(session, url, CHAT) == 200
        assert emu.proc.poll() is None
        with pytest.raises(aiohttp.ClientError):
            await _status(session, url, CHAT)
    returncode = await asyncio.to_thread(emu.proc.wait, 10)
    assert returncode == 3  # os._exit(3): a crash, not the clean exit 0 of SIGTERM
    assert "crash_after=2 reached" in emu.log()


async def test_leak_mb_per_req_really_grows_rss(start_emulator: StartEmulator) -> None:
    emu = start_emulator("--leak-mb-per-req", "20", "--ttft-ms", "0")
    proc = psutil.Process(emu.pid)
    url = f"{emu.url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        before = proc.memory_info().rss
        for _ in range(3):
            assert await _status(session, url, CHAT) == 200
        after = proc.memory_info().rss
    grown_mib = (after - before) / MiB
    assert grown_mib >= 3 * 15, f"RSS grew by {grown_mib:.1f} MiB over 3 requests"


def test_a_leak_under_a_page_leaks_a_page_rather_than_fail_the_request() -> None:
    """A leak of 1e-7 MB mapped 0 bytes, which mmap refuses: every request answered 500."""
    import mmap

    from promptlb.emulator._faults import leak

    kept = leak(1e-7)
    assert kept is not None and len(kept) == mmap.PAGESIZE
    kept.close()
