"""Proxy overhead: the gateway (the middleware on one uvicorn worker) against the emulator direct.

Measures, for non-streamed chat requests to an instant emulated node:
- added latency: sequential requests, p50/p99 through the gateway minus direct;
- throughput: max req/s at a fixed concurrency, direct and through the gateway.
Goals (issue 3): <= 1 ms p50 added, >= 1,500 req/s through the gateway. The load generator, the
gateway and the emulator share this machine's cores, which the report notes.
Prints a table and writes bench/results/proxy.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from typing import Any

import aiohttp
from promptlb.bench._report import RESULTS, environment, write_json
from promptlb.emulator import Service, start_service

BODY = json.dumps(
    {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]}
).encode()
HEADERS = {"content-type": "application/json"}


async def latencies(http: aiohttp.ClientSession, url: str, count: int) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        async with http.post(url, data=BODY, headers=HEADERS) as response:
            await response.read()
            assert response.status == 200, response.status
        out.append(time.perf_counter() - start)
    return out


async def throughput(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    done = 0
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < deadline:
                async with http.post(url, data=BODY, headers=HEADERS) as response:
                    await response.read()
                    if response.status == 200:
                        done += 1
                    else:
                        errors += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"requests_per_s": done / elapsed, "requests": done, "errors": errors}


def ok(good: bool) -> str:
    return "ok" if good else "MISS"


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def cpu_s(service: Service) -> float:
    with open(f"/proc/{service.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(count: int, seconds: float, concurrency: int) -> dict[str, Any]:
    model = start_service(
        "emulator", "--model", "m", "--ttft-ms", "0", "--tokens-per-s", "1000000", "--slots", "1024"
    )
    gateway: Service | None = None
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(f"[[nodes]]\nname = 'a'\nurl = '{model.url}'\nmodels = ['m']\n")
        gateway = start_service("middleware", "--config", f.name, "--log-level", "warning")
        os.unlink(f.name)
        direct = model.url + "/v1/chat/completions"
        via = gateway.url + "/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            await latencies(http, direct, 200)  # warm both paths: connections, caches
            await latencies(http, via, 200)
            direct_lat = await latencies(http, direct, count)
            via_lat = await latencies(http, via, count)
        cpu_before = cpu_s(gateway)
        direct_tp = await throughput(direct, concurrency, seconds)
        via_tp = await throughput(via, concurrency, seconds)
        gateway_cpu = cpu_s(gateway) - cpu_before
    finally:
        if gateway is not None:
            gateway.stop()
        model.stop()
    p50_d, p50_v = statistics.median(direct_lat), statistics.median(via_lat)
    return {
        "latency_ms": {
            "direct_p50": p50_d * 1e3,
            "direct_p99": pct(direct_lat, 0.99) * 1e3,
            "gateway_p50": p50_v * 1e3,
            "gateway_p99": pct(via_lat, 0.99) * 1e3,
            "added_p50": (p50_v - p50_d) * 1e3,
            "added_p99": (pct(via_lat, 0.99) - pct(direct_lat, 0.99)) * 1e3,
            "requests_each": count,
        },
        "throughput": {
            "direct": direct_tp,
            "gateway": via_tp,
            "concurrency": concurrency,
            "seconds_each": seconds,
            "gateway_cpu_ms_per_request": gateway_cpu * 1e3 / max(1, via_tp["requests"]),
        },
        "goals": {"added_p50_ms": 1.0, "gateway_requests_per_s": 1500},
        "note": "client, gateway and emulator share this machine's cores",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=2000, help="sequential requests per path")
    parser.add_argument("--seconds", type=float, default=5.0, help="throughput run per path")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    count, seconds = (300, 1.0) if args.quick else (args.count, args.seconds)
    report = {
        "benchmark": "proxy",
        **environment(),  # commit, dirty, when, python, cores: what was measured, where
        **asyncio.run(run(count, seconds, args.concurrency)),
    }
    lat, tp = report["latency_ms"], report["throughput"]
    print(
        f"latency p50: direct {lat['direct_p50']:.2f} ms, gateway {lat['gateway_p50']:.2f} ms,"
        f" added {lat['added_p50']:.2f} ms (goal <= 1 ms: {ok(lat['added_p50'] <= 1.0)})"
    )
    print(
        f"latency p99: direct {lat['direct_p99']:.2f} ms, gateway {lat['gateway_p99']:.2f} ms,"
        f" added {lat['added_p99']:.2f} ms"
    )
    print(
        f"throughput at {tp['concurrency']} concurrent: direct "
        f"{tp['direct']['requests_per_s']:.0f} req/s, gateway "
        f"{tp['gateway']['requests_per_s']:.0f} req/s (goal >= 1500: "
        f"{ok(tp['gateway']['requests_per_s'] >= 1500)}), gateway CPU "
        f"{tp['gateway_cpu_ms_per_request']:.2f} ms/request"
    )
    # A quick run is a smoke check: it must never replace the committed full-run numbers.
    out = RESULTS / "quick" / "proxy.json" if args.quick else RESULTS / "proxy.json"
    write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
