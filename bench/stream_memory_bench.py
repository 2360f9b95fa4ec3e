"""The gateway's memory over a burst of concurrent streams: RSS before, at its peak, when the
streams have ended and ``--settle`` seconds later, per round.

Real processes: one emulator and ``promptlb-gateway`` in front of it, with a ``[cache]`` (Redis,
or in memory) or none. Each round opens ``--streams`` streams at once, each ``--seconds`` long
at the emulator's ``--tokens-per-s`` and one event every ``--interval-ms`` (the fault suite's
soak: 400 and 500). With ``--entry-bytes`` under what a stream carries, every stream passes the
cache's entry limit midway and is given up, as the soak's ten-minute streams are; above it,
every stream is assembled whole and stored. A second round shows whether the memory a first
one left is reused or added to. A few minutes on 2 cores at the defaults. Writes
bench/results/quick/stream_memory.json (not committed).

    python bench/stream_memory_bench.py --cache redis --entry-bytes 100000
    python bench/stream_memory_bench.py --cache none
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from promptlb.bench._faults import rss_mb
from promptlb.bench._report import RESULTS, environment, write_json
from promptlb.emulator import Service, start_redis, start_service


async def one_round(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    body = {
        "model": "m",
        "max_tokens": int(args.tokens_per_s * args.seconds),
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
    }
    peak = 0.0
    whole = 0
    streaming = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not streaming.is_set():
            peak = max(peak, rss_mb(pid))
            await asyncio.sleep(0.5)

    async def stream(http: aiohttp.ClientSession) -> None:
        nonlocal whole
        async with http.post(url + "/v1/chat/completions", json=body) as response:
            last = b""
            async for chunk in response.content.iter_any():
                last = chunk
            whole += response.status == 200 and last.rstrip().endswith(b"[DONE]")

    watcher = asyncio.ensure_future(watch())
    started = time.monotonic()
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=args.seconds + 120),
        connector=aiohttp.TCPConnector(limit=0),
    ) as http:
        await asyncio.gather(*(stream(http) for _ in range(args.streams)))
    took = time.monotonic() - started
    streaming.set()
    await watcher
    ended = rss_mb(pid)
    await asyncio.sleep(args.settle)
    return {
        "whole": whole,
        "seconds": round(took, 1),
        "peak_mb": round(peak, 1),
        "ended_mb": round(ended, 1),
        "settled_mb": round(rss_mb(pid), 1),
    }


async def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        for _ in range(20):  # every path the streams take, warm before the baseline
            data = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
            async with http.post(url + "/v1/chat/completions", json=data) as response:
                await response.read()
    await asyncio.sleep(1.0)
    before = rss_mb(pid)
    print(f"gateway RSS before: {before:.1f} MB", flush=True)
    rounds = []
    for i in range(args.rounds):
        row = await one_round(url, pid, args)
        growth = row["settled_mb"] / before - 1.0
        row["growth"] = round(growth, 3)
        rounds.append(row)
        print(
            f"round {i + 1}: {row['whole']}/{args.streams} streams whole in {row['seconds']}s; "
            f"RSS peak {row['peak_mb']}, at the end {row['ended_mb']}, {args.settle:g}s later "
            f"{row['settled_mb']} MB ({100 * growth:+.1f}%)",
            flush=True,
        )
    return {"before_mb": round(before, 1), "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0, help="each stream's length")
    parser.add_argument("--tokens-per-s", type=float, default=400.0)
    parser.add_argument("--interval-ms", type=float, default=500.0)
    parser.add_argument("--cache", choices=["redis", "memory", "none"], default="redis")
    parser.add_argument("--entry-bytes", type=int, default=None, help="the cache's entry limit")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after each round")
    parser.add_argument("--out", type=Path, default=RESULTS / "quick" / "stream_memory.json")
    args = parser.parse_args()
    binary = shutil.which("redis-server")
    if args.cache == "redis" and binary is None:
        raise SystemExit("stream_memory_bench: redis-server is not installed")
    services: list[Service] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model = start_service(
                "emulator",
                *("--model", "m", "--slots", str(max(8, args.streams)), "--ttft-ms", "30"),
                *("--tokens-per-s", str(args.tokens_per_s)),
                *("--stream-interval-ms", str(args.interval_ms)),
            )
            services.append(model)
            config = "[health]\ninterval = '1s'\n[retry]\ntotal_timeout = '1h'\n"
            if args.cache != "none":
                backend = "memory"
                if args.cache == "redis" and binary is not None:
                    redis = start_redis(binary, tmp)
                    services.append(redis)  # stopped after the gateway that uses it
                    backend = redis.url
                config += f"[cache]\nbackend = '{backend}'\n"
                if args.entry_bytes is not None:
                    config += f"max_entry_bytes = {args.entry_bytes}\n"
            config += f"[[nodes]]\nname = 'a'\nurl = '{model.url}'\nmodels = ['m']\n"
            path = Path(tmp) / "gateway.toml"
            path.write_text(config)
            gateway = start_service("middleware", "--config", str(path), "--log-level", "error")
            services.append(gateway)
            report = asyncio.run(measure(gateway.url, gateway.pid, args))
        finally:
            for service in reversed(services):
                service.stop()
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_json(args.out, {"benchmark": "stream_memory", **environment(), **settings, **report})


if __name__ == "__main__":
    main()
