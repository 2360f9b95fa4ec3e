"""``promptlb-bench endpoint URL``: capacity planning against any OpenAI-compatible endpoint.

At each concurrency level, that many clients send streamed chat completions back to back
(a closed loop: the level is the load) for ``--seconds``; each level reports latency and TTFT
percentiles and the throughput reached. The best throughput of any level is what one endpoint
can do, and the node count for ``--target-rate`` plans for 120% of it (the seed's "plan for
120% of peak"): nodes = ceil(1.2 x target / best throughput).

An ``OPENAI_API_KEY`` in the environment is sent as the bearer token.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from ._loadgen import Result, chat_body, request_once, request_timeout
from ._report import RESULTS, environment, write_json
from ._scenario import Arrival
from ._stats import percentile

__all__ = ["HEADROOM", "nodes_needed", "run_endpoint"]

HEADROOM = 1.2
REQUEST_TIMEOUT_S = 60.0
MAX_SECONDS = 3600.0  # a level's length at most: the load loop is bounded in time


def nodes_needed(target_rate: float, best_rps: float, headroom: float = HEADROOM) -> int | None:
    """Endpoints like the one measured needed for ``target_rate`` with headroom; None when
    nothing succeeded, so no throughput is known."""
    if best_rps <= 0:
        return None
    return max(1, math.ceil(headroom * target_rate / best_rps))


async def level(
    url: str,
    model: str,
    concurrency: int,
    seconds: float,
    max_tokens: int,
    prompts: Iterator[int] | None = None,
) -> dict[str, Any]:
    """``concurrency`` closed-loop clients for ``seconds``; requests in flight at the deadline
    finish (each bounded by its own timeout) and count. Each request has a prompt of its own,
    numbered by ``prompts`` (shared by the levels of one run): the same prompt every time is a
    prefix-cache hit after the first on a real engine, and reads fast."""
    numbers = prompts if prompts is not None else itertools.count()
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    if key := os.environ.get("OPENAI_API_KEY"):
        headers["authorization"] = f"Bearer {key}"
    arrival = Arrival(0.0, "endpoint", 64, max_tokens)
    loop = asyncio.get_running_loop()
    results: list[Result] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=request_timeout(REQUEST_TIMEOUT_S)
    ) as http:
        t0 = loop.time()

        def clock() -> float:
            return loop.time() - t0

        # Uncounted: each client's connection is opened before the clock starts, so that the
        # level's few-sample p99 is not its connection setup.
        warm = [Result(-1, "endpoint", max_tokens, at=0.0) for _ in range(concurrency)]
        bodies = [chat_body(model, arrival, next(numbers)) for _ in warm]
        await asyncio.gather(
            *(
                request_once(http, endpoint, body, r, clock, {}, headers)
                for body, r in zip(bodies, warm, strict=True)
            )
        )
        t0 = loop.time()

        async def client() -> None:
            while clock() < seconds:
                result = Result(len(results), "endpoint", max_tokens, at=clock(), start=clock())
                results.append(result)
                body = chat_body(model, arrival, next(numbers))
                await request_once(http, endpoint, body, result, clock, {}, headers)
                if result.error:
                    await asyncio.sleep(0.05)  # a failing endpoint is not hammered in a spin

        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = clock()
    ok = [r for r in results if r.ok]
    # Completed by the deadline, over the level's seconds: the tail after it (no new requests
    # sent, those still running finishing) made the rate low, by 7% with 3 s requests at 10 s.
    done = sum(1 for r in ok if r.end <= seconds)
    lat = [r.latency for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(ok),
        "errors": errors,
        "seconds": round(elapsed, 3),
        "throughput_rps": round(done / seconds, 3) if seconds > 0 else 0.0,
        "latency_ms": {f"p{p}": ms(percentile(lat, p)) for p in (50, 90, 99)},
        "ttft_ms": {f"p{p}": ms(percentile(ttft, p)) for p in (50, 90, 99)},
        "nodes_seen": sorted({r.node for r in ok}),  # behind promptlb: which nodes answered
    }


def _levels(raw: str) -> list[int]:
    try:
        levels = [int(v) for v in raw.split(",") if v.strip()]
    except ValueError:
        levels = []
    if not levels or any(v < 1 for v in levels):
        raise SystemExit(f"promptlb-bench endpoint: --concurrency {raw!r}: expected e.g. 1,2,4,8")
    return levels


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


async def _measure(args: argparse.Namespace, levels: list[int]) -> list[dict[str, Any]]:
    rows = []
    # From a random number: a run again against the same engine must not find the last run's
    # prompts in its cache either.
    prompts = itertools.count(random.randrange(1 << 48))
    for c in levels:
        print(f"  concurrency {c:>4}: {args.seconds:g}s ...", file=sys.stderr, flush=True)
        rows.append(await level(args.url, args.model, c, args.seconds, args.max_tokens, prompts))
    return rows


def run_endpoint(args: argparse.Namespace) -> None:
    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SystemExit(f"promptlb-bench endpoint: {args.url!r} is not an http(s) URL")
    # An OpenAI base URL ends in /v1 (the openai client's base_url): every request went to
    # /v1/v1/chat/completions and failed 404.
    args.url = re.sub(r"/v1/*$", "", args.url.rstrip("/"))
    # Checked before any level runs: NaN passed `<= 0`, and a NaN or infinite target rate
    # failed the plan after every level had run, the measurement lost behind a traceback.
    if not (math.isfinite(args.seconds) and 0 < args.seconds <= MAX_SECONDS):
        raise SystemExit(f"promptlb-bench endpoint: --seconds must be in (0, {MAX_SECONDS:g}]")
    if args.max_tokens < 1:
        raise SystemExit("promptlb-bench endpoint: --max-tokens must be >= 1")
    if args.target_rate is not None and not (
        math.isfinite(args.target_rate) and args.target_rate > 0
    ):
        raise SystemExit("promptlb-bench endpoint: --target-rate must be a number > 0")
    levels = _levels(args.concurrency)
    rows = asyncio.run(_measure(args, levels))
    best = max(rows, key=lambda r: r["throughput_rps"])
    report: dict[str, Any] = {
        "benchmark": "endpoint",
        **environment(),
        "url": args.url,
        "model": args.model,
        "max_tokens": args.max_tokens,
        "seconds_each": args.seconds,
        "levels": rows,
        "best": {"concurrency": best["concurrency"], "throughput_rps": best["throughput_rps"]},
    }
    if args.target_rate is not None:
        report["plan"] = {
            "target_rps": args.target_rate,
            "headroom": HEADROOM,
            "nodes": nodes_needed(args.target_rate, best["throughput_rps"]),
        }
    head = (
        f"{'conc':>5} {'reqs':>6} {'err':>5} {'rps':>8} {'p50':>7} {'p90':>7} {'p99':>7} "
        f"{'ttft50':>7} {'ttft99':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        lat, ttft = r["latency_ms"], r["ttft_ms"]
        print(
            f"{r['concurrency']:>5} {r['requests']:>6} {r['requests'] - r['ok']:>5} "
            f"{r['throughput_rps']:>8.2f} {_fmt(lat['p50']):>7} {_fmt(lat['p90']):>7} "
            f"{_fmt(lat['p99']):>7} {_fmt(ttft['p50']):>7} {_fmt(ttft['p99']):>7}"
        )
    print(f"best: {best['throughput_rps']:.2f} req/s at concurrency {best['concurrency']}")
    if "plan" in report:
        plan = report["plan"]
        if plan["nodes"] is None:
            print(f"plan: no request succeeded, no node count for {args.target_rate:g} req/s")
        else:
            print(
                f"plan: {plan['nodes']} endpoint(s) like this one for {args.target_rate:g} req/s "
                f"with {HEADROOM - 1:.0%} headroom"
            )
    out = Path(args.out) if args.out else RESULTS
    name = re.sub(r"[^A-Za-z0-9.-]+", "-", parts.netloc).strip("-") or "endpoint"
    path = out / f"endpoint-{name}.json"
    write_json(path, report)
    print(f"wrote {path}")
