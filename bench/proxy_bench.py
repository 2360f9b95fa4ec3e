"""Proxy overhead: the gateway against the Python floor, side by side on one upstream.

Three paths to the same instant emulated node, in one run: direct, through the floor (a minimal
pure-ASGI forwarder with one aiohttp session, `bench/floor.py`, on the gateway's own server
stack) and through the gateway (the middleware with its default strategy and metrics on):
- added latency: sequential requests, p50/p99 through each hop minus direct, in blocks of a
  hundred that the three paths take in turn;
- throughput at a fixed concurrency (wrk when installed, else an aiohttp loop), and each hop
  process's CPU per request, in rounds the two hops take in turn (pooled per hop).
This machine's speed drifts by a tenth or more within minutes: measured one after the other,
the hops' ratios moved by that much from run to run; taking turns puts each drift on both.
The gateway is reported as ratios to the floor, which hold across machines and days where the
absolute numbers do not. Targets: >= 0.8x the floor's req/s, <= 1.25x its CPU per request,
added p50 <= 1.1x the floor's. Prints a table and writes bench/results/proxy.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp
from promptlb.bench._loadgen import request_timeout
from promptlb.bench._report import RESULTS, environment, write_json
from promptlb.bench._stats import percentile
from promptlb.emulator import Service, start_service

BODY = json.dumps(
    {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]}
).encode()
HEADERS = {"content-type": "application/json"}


async def latencies(
    http: aiohttp.ClientSession, urls: dict[str, str], count: int, block: int = 100
) -> dict[str, list[float]]:
    """``count`` sequential requests through each path, in blocks of ``block`` that the paths
    take in turn (the order rotating), so that the machine's drift over the run falls on every
    path alike. Blocks, not single requests: a hop that serves one request in three would
    find its caches taken by the others each time, which no real gateway does."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    names = list(urls)
    for turn in range(-(-count // block)):
        first = turn % len(names)
        for name in names[first:] + names[:first]:
            for _ in range(min(block, count - turn * block)):
                start = time.perf_counter()
                async with http.post(urls[name], data=BODY, headers=HEADERS) as response:
                    await response.read()
                    assert response.status == 200, response.status
                out[name].append(time.perf_counter() - start)
    return out


async def throughput(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    done = 0
    errors = 0
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), timeout=TIMEOUT
    ) as http:
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
    return {
        "requests_per_s": done / elapsed,
        "requests": done,
        "errors": errors,
        "seconds": elapsed,
    }


def ok(good: bool) -> str:
    return "ok" if good else "MISS"


def pct(values: list[float], p: float) -> float:
    """The bench's one percentile rule (`_stats.percentile`), ``p`` in 0..1."""
    found = percentile(values, p * 100)
    assert found is not None, "no values"
    return found


def cpu_s(service: Service) -> float:
    with open(f"/proc/{service.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Each request's limit against an instant upstream: aiohttp's default of 5 minutes would let
# one hung request stall the run that long.
TIMEOUT = request_timeout(10.0)
# (sequential requests per path, seconds a throughput round, rounds per hop): the full run
# proxy.json records, and the smoke run.
FULL = (2000, 2.0, 4)
QUICK = (300, 1.0, 2)
CONCURRENCY = 32
TARGETS = {"requests_per_s_ratio": 0.8, "cpu_per_request_ratio": 1.25, "added_p50_ratio": 1.1}


def wrk(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    """wrk's count over ``seconds`` at ``concurrency`` connections, POSTing the chat body."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(
            f'wrk.method = "POST"\nwrk.body = {json.dumps(BODY.decode())}\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
        )
    try:
        out = subprocess.run(
            [
                "wrk",
                "-t1",
                f"-c{concurrency}",
                f"-d{seconds:g}s",  # whole seconds: `main` rounds them for wrk
                "-s",
                script.name,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=True,
        ).stdout
    finally:
        os.unlink(script.name)
    done = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    assert done is not None, out
    elapsed = float(done.group(2)) / (1000 if done.group(3) == "ms" else 1)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = int(bad.group(1)) if bad else 0
    requests = int(done.group(1)) - errors
    return {
        "requests_per_s": requests / elapsed,
        "requests": requests,
        "errors": errors,
        "seconds": elapsed,
    }


async def load(url: str, concurrency: int, seconds: float, service: Service) -> dict[str, float]:
    """Throughput through ``service`` and its CPU per request over the same window."""
    before = cpu_s(service)
    if shutil.which("wrk"):
        result = await asyncio.to_thread(wrk, url, concurrency, seconds)
    else:
        result = await throughput(url, concurrency, seconds)
    result["cpu_us_per_request"] = (cpu_s(service) - before) * 1e6 / max(1, result["requests"])
    return result


async def run(count: int, seconds: float, concurrency: int, rounds: int) -> dict[str, Any]:
    model = start_service(
        "emulator", "--model", "m", "--ttft-ms", "0", "--tokens-per-s", "1000000", "--slots", "1024"
    )
    hops: dict[str, Service] = {}
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(f"[[nodes]]\nname = 'a'\nurl = '{model.url}'\nmodels = ['m']\n")
        hops["floor"] = start_service("bench.floor", "--upstream", model.url)
        hops["gateway"] = start_service("middleware", "--config", f.name, "--log-level", "warning")
        os.unlink(f.name)
        urls = {"direct": model.url, **{k: v.url for k, v in hops.items()}}
        urls = {k: u + "/v1/chat/completions" for k, u in urls.items()}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            await latencies(http, urls, 200)  # warm every path: connections, caches
            lat = await latencies(http, urls, count)
        # Rounds, the hops taking turns: a slow spell of this shared machine lands on both.
        per_round: dict[str, list[dict[str, float]]] = {name: [] for name in hops}
        names = list(hops)
        for r in range(rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                per_round[name].append(await load(urls[name], concurrency, seconds, hops[name]))
    finally:
        for service in hops.values():
            service.stop()
        model.stop()
    p50 = {k: statistics.median(v) * 1e3 for k, v in lat.items()}
    p99 = {k: pct(v, 0.99) * 1e3 for k, v in lat.items()}
    added = {k: p50[k] - p50["direct"] for k in hops}
    tp = {name: _pooled(results) for name, results in per_round.items()}
    floor, gateway = tp["floor"], tp["gateway"]
    ratios = {
        "requests_per_s_ratio": gateway["requests_per_s"] / floor["requests_per_s"],
        "cpu_per_request_ratio": gateway["cpu_us_per_request"] / floor["cpu_us_per_request"],
        "added_p50_ratio": added["gateway"] / added["floor"] if added["floor"] > 0 else None,
    }
    verdicts = {
        key: None if value is None else ("met" if _meets(key, value) else "missed")
        for key, value in ratios.items()
    }
    rounds_out = [
        {
            "requests_per_s_ratio": g["requests_per_s"] / f["requests_per_s"],
            "cpu_per_request_ratio": g["cpu_us_per_request"] / f["cpu_us_per_request"],
        }
        for f, g in zip(per_round["floor"], per_round["gateway"], strict=True)
    ]
    return {
        "latency_ms": {
            **{f"{k}_p50": v for k, v in p50.items()},
            **{f"{k}_p99": v for k, v in p99.items()},
            **{f"{k}_added_p50": v for k, v in added.items()},
            "requests_each": count,
            "interleaved": True,
        },
        "throughput": {
            **tp,
            "client": "wrk" if shutil.which("wrk") else "aiohttp",
            "concurrency": concurrency,
            "seconds_per_round": seconds,
            "rounds": rounds,
        },
        "ratios": ratios,
        "round_ratios": rounds_out,
        "targets": TARGETS,
        "verdicts": verdicts,
        "note": "client, hops and emulator share this machine's cores; ratios are from one run:"
        " sequential requests interleaved across the paths, load in rounds the hops take in turn,"
        " each hop's figures pooled over its rounds",
    }


def _pooled(results: list[dict[str, float]]) -> dict[str, float]:
    """One hop's rounds as one run: requests and CPU summed, over the time they took."""
    requests = sum(r["requests"] for r in results)
    cpu_us = sum(r["cpu_us_per_request"] * max(1, r["requests"]) for r in results)
    return {
        "requests_per_s": requests / sum(r["seconds"] for r in results),
        "requests": requests,
        "errors": sum(r["errors"] for r in results),
        "cpu_us_per_request": cpu_us / max(1, requests),
    }


def _meets(key: str, value: float) -> bool:
    target = TARGETS[key]
    return value >= target if key == "requests_per_s_ratio" else value <= target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--count",
        type=int,
        default=None,
        help=f"sequential requests per path ({FULL[0]}; quick {QUICK[0]})",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help=f"each throughput round ({FULL[1]:g}; quick {QUICK[1]:g}), whole seconds when wrk"
        " runs the load",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"rounds per hop ({FULL[2]}; quick {QUICK[2]})"
    )
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: the figures in brackets above"
    )
    args = parser.parse_args()
    # --quick sets the sizes not given: a size given is used as given, never overridden.
    sizes = QUICK if args.quick else FULL
    count = args.count if args.count is not None else sizes[0]
    seconds = args.seconds if args.seconds is not None else sizes[1]
    rounds = args.rounds if args.rounds is not None else sizes[2]
    if count < 1 or seconds <= 0 or rounds < 1 or args.concurrency < 1:
        parser.error("--count, --rounds and --concurrency must be >= 1, --seconds > 0")
    if shutil.which("wrk") and seconds != max(1, round(seconds)):
        seconds = max(1, round(seconds))
        print(f"proxy_bench: wrk runs whole seconds: --seconds {seconds}", file=sys.stderr)
    # Anything but the full run's settings is not the run `proxy.json` records.
    full = (count, seconds, rounds) == FULL and args.concurrency == CONCURRENCY
    report = {
        "benchmark": "proxy",
        **environment(),  # commit, dirty, when, python, cores: what was measured, where
        **asyncio.run(run(count, seconds, args.concurrency, rounds)),
    }
    lat, tp, ratios = report["latency_ms"], report["throughput"], report["ratios"]
    for hop in ("floor", "gateway"):
        print(
            f"{hop:8} added p50 {lat[hop + '_added_p50']:.3f} ms, {tp[hop]['requests_per_s']:.0f}"
            f" req/s at {tp['concurrency']} concurrent ({tp['client']}),"
            f" {tp[hop]['cpu_us_per_request']:.0f} us CPU/request"
        )
    for key in ("requests_per_s_ratio", "cpu_per_request_ratio"):
        each = ", ".join(f"{r[key]:.2f}x" for r in report["round_ratios"])
        print(f"gateway/floor {key} by round: {each}")
    for key, value in ratios.items():
        shown = "n/a" if value is None else f"{value:.2f}x"
        print(f"gateway/floor {key}: {shown} (target {TARGETS[key]}x: {report['verdicts'][key]})")
    # A quick or resized run must never replace the committed full-run numbers.
    out = RESULTS / "proxy.json" if full else RESULTS / "quick" / "proxy.json"
    write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
