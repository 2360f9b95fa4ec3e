"""Prefix caching in the emulator: a cached prefix saves its share of TTFT, an LRU bounds the
cache, and the stats and vLLM-style metrics count queries and hits."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from promptlb.emulator._config import EmulatorConfig
from promptlb.shared import ConfigError

if TYPE_CHECKING:
    from tests.emulator.conftest import StartEmulator

TIMEOUT = aiohttp.ClientTimeout(total=30)
SYSTEM = "You answer questions about the emulator's prefix cache, briefly. " * 10  # ~650 chars


def chat(system: str, *turns: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user", "content": t} for t in turns]
    return {"model": "emulated", "messages": messages, "max_tokens": 2, "stream": True}


async def ttft(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """Seconds to the first streamed chunk; the rest is read to the end."""
    started = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200
        await response.content.readany()
        first = time.perf_counter() - started
        await response.read()
    return first


async def stats(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with http.get(f"{url}/_emulator/stats") as response:
        data: dict[str, int] = await response.json()
    return data


async def test_a_cached_prefix_saves_its_share_of_ttft(start_emulator: StartEmulator) -> None:
    emu = start_emulator(
        *("--ttft-ms", "400", "--prefix-discount", "0.75", "--prefix-cache-entries", "2"),
        *("--stream-interval-ms", "5", "--tokens-per-s", "1000"),
    )
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        miss = await ttft(http, emu.url, chat(SYSTEM, "first question"))
        # the same system prompt, a conversation grown since: its first 512 characters match
        hit = await ttft(http, emu.url, chat(SYSTEM, "first question", "an answer", "and then?"))
        assert (await stats(http, emu.url))["prefix_cache_hits"] == 1
        assert miss >= 0.4
        assert hit < miss * 0.6  # 100 ms against 400: loose, the machine is shared
        # two other prefixes push the first out of a two-entry cache
        await ttft(http, emu.url, chat("Another system prompt. " * 30, "q"))
        await ttft(http, emu.url, chat("A third system prompt. " * 30, "q"))
        again = await ttft(http, emu.url, chat(SYSTEM, "first question"))
        assert again >= 0.4
        # a short prompt is its own prefix, whole
        await ttft(http, emu.url, chat("short", "q"))
        await ttft(http, emu.url, chat("short", "q"))
        await ttft(http, emu.url, chat("short", "r"))
        counts = await stats(http, emu.url)
        async with http.get(f"{emu.url}/metrics") as response:
            text = await response.text()
    assert counts["prefix_cache_queries"] == 8
    assert counts["prefix_cache_hits"] == 2
    metrics = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert metrics["vllm:prefix_cache_hits_total"] > 0
    assert metrics["vllm:prefix_cache_queries_total"] > metrics["vllm:prefix_cache_hits_total"]


async def test_without_a_discount_hits_are_counted_but_cost_the_same(
    start_emulator: StartEmulator,
) -> None:
    emu = start_emulator("--ttft-ms", "200", "--stream-interval-ms", "5")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        await ttft(http, emu.url, chat(SYSTEM, "q"))
        hit = await ttft(http, emu.url, chat(SYSTEM, "q"))
        counts = await stats(http, emu.url)
    assert hit >= 0.2
    assert (counts["prefix_cache_queries"], counts["prefix_cache_hits"]) == (2, 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prefix_discount", 1.5),
        ("prefix_discount", -0.1),
        ("prefix_discount", float("nan")),
        ("prefix_chars", 0),
        ("prefix_cache_entries", -1),
    ],
)
def test_bad_prefix_settings_name_the_field(field: str, value: float) -> None:
    options: dict[str, Any] = {field: value}
    with pytest.raises(ConfigError) as info:
        EmulatorConfig(**options)
    assert info.value.key == field
