"""Faults changed while the emulator runs (``POST /_emulator/faults``), on a real process."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import aiohttp
import psutil
import pytest
from promptlb.emulator import Service, start_service

if TYPE_CHECKING:
    from tests.emulator.conftest import StartEmulator

TIMEOUT = aiohttp.ClientTimeout(total=30)
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def plain() -> Iterator[Service]:
    """One emulator for the checks that must leave its state as it was."""
    emu = start_service("emulator")
    try:
        yield emu
    finally:
        emu.stop()


async def _faults(
    session: aiohttp.ClientSession, url: str, body: object
) -> tuple[int, dict[str, Any]]:
    async with session.post(f"{url}/_emulator/faults", json=body) as resp:
        return resp.status, await resp.json()


async def _chat_s(session: aiohttp.ClientSession, url: str) -> float:
    start = time.monotonic()
    async with session.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
        await resp.read()
        assert resp.status == 200
    return time.monotonic() - start


async def test_get_shows_the_cli_flags_as_the_starting_state(
    start_emulator: StartEmulator,
) -> None:
    emu = start_emulator("--slow-factor", "1.5", "--leak-mb-per-req", "0.5")
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(f"{emu.url}/_emulator/faults") as resp,
    ):
        assert resp.status == 200
        state = await resp.json()
    assert state == {
        "slow_factor": 1.5,
        "hang": False,
        "leak_mb_per_req": 0.5,
        "error_rate": 0.0,
        "poison": "",
    }


async def test_slow_factor_applies_to_the_next_requests(start_emulator: StartEmulator) -> None:
    # 5 tokens at 100/s + 20 ms TTFT: ~70 ms; slowed 20x: ~1.4 s. Compared with each other, so
    # that a loaded machine's extra milliseconds do not decide it.
    emu = start_emulator("--ttft-ms", "20", "--tokens-per-s", "100")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        fast = await _chat_s(session, emu.url)
        status, state = await _faults(session, emu.url, {"slow_factor": 20})
        assert status == 200 and state["slow_factor"] == 20.0
        slow = await _chat_s(session, emu.url)
        await _faults(session, emu.url, {"slow_factor": 1})
        again = await _chat_s(session, emu.url)
    assert slow > 1.0 and slow > 5 * fast
    assert again < slow / 3


async def test_hang_holds_requests_until_lifted(start_emulator: StartEmulator) -> None:
    emu = start_emulator("--ttft-ms", "0", "--tokens-per-s", "10000")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        status, state = await _faults(session, emu.url, {"hang": True})
        assert status == 200 and state["hang"] is True
        pending = asyncio.create_task(_chat_s(session, emu.url))
        done, _ = await asyncio.wait({pending}, timeout=0.5)
        assert not done  # hung
        async with session.get(f"{emu.url}/health") as resp:
            assert resp.status == 200  # a gray failure: the process still answers its health
        body = {"messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{emu.url}/_emulator/oracle", json=body) as resp:
            assert resp.status == 503  # but the oracle takes it for no candidate
        lifted_at = time.monotonic()
        await _faults(session, emu.url, {"hang": False})
        await asyncio.wait_for(pending, timeout=5)
        assert time.monotonic() - lifted_at < 1.0


async def test_leak_and_free_leaked_move_the_rss(start_emulator: StartEmulator) -> None:
    emu = start_emulator("--ttft-ms", "0", "--tokens-per-s", "10000")
    proc = psutil.Process(emu.pid)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await _chat_s(session, emu.url)
        # Three cycles: after the first free, glibc took later leaks from its heap (its mmap
        # threshold raised by the freed block), and freeing them gave no RSS back (49 -> 49 MB).
        for _ in range(3):
            before = proc.memory_info().rss
            await _faults(session, emu.url, {"leak_mb_per_req": 8})
            for _ in range(5):
                await _chat_s(session, emu.url)
            leaked = proc.memory_info().rss
            off = {"leak_mb_per_req": 0, "free_leaked": True}
            status, state = await _faults(session, emu.url, off)
            assert status == 200 and state["leak_mb_per_req"] == 0.0
            freed = proc.memory_info().rss
            assert leaked - before >= 30 * MiB  # 5 x 8 MiB, pages touched
            assert leaked - freed >= 30 * MiB  # given back, every time


async def test_error_rate_can_be_switched_on(start_emulator: StartEmulator) -> None:
    emu = start_emulator("--ttft-ms", "0", "--tokens-per-s", "10000")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await _faults(session, emu.url, {"error_rate": 1.0})
        async with session.post(f"{emu.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 500
        await _faults(session, emu.url, {"error_rate": 0})
        await _chat_s(session, emu.url)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"slow_factor": 0}, "slow_factor"),
        ({"slow_factor": -1}, "slow_factor"),
        ({"slow_factor": "2"}, "slow_factor"),
        ({"slow_factor": True}, "slow_factor"),
        ({"slow_factor": 1e-320}, "slow_factor"),  # an infinite rate: every request a 500
        ({"slow_factor": 10**400}, "slow_factor"),  # past a float: a 500 of its own
        ({"hang": 1}, "hang"),
        ({"leak_mb_per_req": -4}, "leak_mb_per_req"),
        ({"leak_mb_per_req": 1e9}, "leak_mb_per_req"),  # then every request failed
        ({"error_rate": 1.5}, "error_rate"),
        ({"free_leaked": "yes"}, "free_leaked"),
        ({"crash": True}, "crash"),
        ([1, 2], "object"),
    ],
)
async def test_bad_input_is_400_and_changes_nothing(
    plain: Service, body: object, named: str
) -> None:
    emu = plain
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        # A valid key beside the bad one must not apply either: all are checked first.
        sent = (
            {**body, "slow_factor": 3}
            if isinstance(body, dict) and named != "slow_factor"
            else body
        )
        status, answer = await _faults(session, emu.url, sent)
        assert status == 400
        assert named in answer["error"]["message"]
        async with session.get(f"{emu.url}/_emulator/faults") as resp:
            assert (await resp.json())["slow_factor"] == 1.0


async def test_body_that_is_not_json_is_400(plain: Service) -> None:
    emu = plain
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(f"{emu.url}/_emulator/faults", data=b"{nope") as resp,
    ):
        assert resp.status == 400


async def test_stats_count_generations_abandoned_by_their_client(
    start_emulator: StartEmulator,
) -> None:
    emu = start_emulator("--ttft-ms", "2000")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await session.post(f"{emu.url}/v1/chat/completions", json=CHAT)
        await asyncio.sleep(0.2)  # the server sees the closed connection
        async with session.get(f"{emu.url}/_emulator/stats") as resp:
            stats = await resp.json()
    assert stats["requests"] == 1
    assert stats["cancelled"] == 1
    assert stats["success"] == 0


async def test_a_poison_matches_its_prompt_however_the_json_writes_it(
    start_emulator: StartEmulator,
) -> None:
    """The marker was looked for in the raw bytes: "naïve" sent by aiohttp's json= (which
    writes na\\u00efve) was answered 200, the same prompt as raw UTF-8 500."""
    emu = start_emulator("--ttft-ms", "0", "--tokens-per-s", "10000")
    body = {"messages": [{"role": "user", "content": "a naïve question"}], "max_tokens": 2}
    url = f"{emu.url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await _faults(session, emu.url, {"poison": "naïve"})
        async with session.post(url, json=body) as escaped:
            assert escaped.status == 500
        raw = json.dumps(body, ensure_ascii=False).encode()
        headers = {"Content-Type": "application/json"}
        async with session.post(url, data=raw, headers=headers) as plain:
            assert plain.status == 500


async def test_a_poison_waits_out_a_hang_and_counts_as_the_nodes_error(
    start_emulator: StartEmulator,
) -> None:
    """Checked in front of everything, a hung node answered the poison at once (and a loading
    one 500 for 503), never counted in its requests or errors."""
    emu = start_emulator("--ttft-ms", "0", "--tokens-per-s", "10000")
    body = {"messages": [{"role": "user", "content": "poisoned"}], "max_tokens": 2}
    url = f"{emu.url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await _faults(session, emu.url, {"poison": "poisoned", "hang": True})
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await session.post(url, json=body)
        await _faults(session, emu.url, {"hang": False})
        async with session.post(url, json=body) as resp:
            assert resp.status == 500
            assert (await resp.json())["error"]["message"] == "emulated crash on a poison request"
        async with session.get(f"{emu.url}/_emulator/stats") as resp:
            stats = await resp.json()
    assert stats["requests"] == 2 and stats["errors"] == 1


async def test_the_oracle_takes_a_loading_or_hung_after_node_for_no_candidate(
    start_emulator: StartEmulator,
) -> None:
    """Only a runtime hang answered 503: a node hung by --hang-after, or still loading, said a
    wait of 0 and drew the live oracle's requests."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    loading = start_emulator("--load-time-s", "30")
    hung = start_emulator("--hang-after", "1", "--ttft-ms", "0", "--tokens-per-s", "10000")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await _chat_s(session, hung.url)  # the one it answers: the next would wait for good
        for emu, why in ((loading, "model is loading"), (hung, "hung")):
            async with session.post(f"{emu.url}/_emulator/oracle", json=body) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["message"] == why


async def test_a_leak_still_being_made_when_freed_is_freed_too(
    start_emulator: StartEmulator,
) -> None:
    """A leak is made in a thread; one still being made when free_leaked came was kept after
    it, and outlived the bench's reset between runs."""
    emu = start_emulator("--ttft-ms", "0", "--tokens-per-s", "10000")
    proc = psutil.Process(emu.pid)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await _chat_s(session, emu.url)
        before = proc.memory_info().rss
        await _faults(session, emu.url, {"leak_mb_per_req": 256})
        asking = asyncio.ensure_future(_chat_s(session, emu.url))
        await asyncio.sleep(0.02)  # the leak under way (about 100 ms for 256 MB)
        await _faults(session, emu.url, {"leak_mb_per_req": 0, "free_leaked": True})
        await asking
        assert proc.memory_info().rss - before < 64 * MiB
