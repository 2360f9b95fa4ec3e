"""The live oracle over real emulators: it routes by their own forecast and cache."""

from __future__ import annotations

import aiohttp
from promptlb.bench._loadgen import UPSTREAM_HEADER
from promptlb.bench._peers import start_oracle

from tests.conftest import Launcher

FLAGS = ("--slots", "1", "--ttft-ms", "0", "--prefill-tokens-per-s", "5000", "--kv-blocks", "500")
HISTORY = [{"role": "system", "content": "Shared rules. " * 300}]  # ~1,000 tokens: 0.2 s


async def test_the_oracle_follows_the_cache_and_avoids_the_queue(launch: Launcher) -> None:
    nodes = {n: launch("emulator", *FLAGS, "--tokens-per-s", "50").url for n in "ab"}
    oracle = start_oracle(nodes)
    try:
        async with aiohttp.ClientSession() as http:

            async def ask(url: str, question: str, max_tokens: int = 2) -> str:
                messages = [*HISTORY, {"role": "user", "content": question}]
                body = {"messages": messages, "max_tokens": max_tokens}
                async with http.post(url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
                    return response.headers.get(UPSTREAM_HEADER, "")

            await ask(nodes["b"], "warm b")  # b holds the history now, a does not
            assert {await ask(oracle.url, f"q{i}") for i in range(4)} == {"b"}
            busy = http.post(
                nodes["b"] + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 100,
                    "stream": True,
                },
            )
            async with busy as response:  # b's one slot held for 2 s: the prefill is cheaper
                await response.content.read(1)
                assert await ask(oracle.url, "while b is busy") == "a"
    finally:
        oracle.stop()
