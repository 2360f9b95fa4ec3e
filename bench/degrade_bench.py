"""Degradation under outage, and cache-hit latency (issue 4).

Real processes: a slow "big" node and a fast "small" node (emulators with sidecars) behind the
gateway with ``big -> [small, cache]``. Open-loop requests over a pool of repeated prompts
(temperature 0, so answers are cacheable):
- ``warm``: everything up; the baseline latency, and the cache fills;
- ``outage``: big is killed (SIGKILL) for ``--outage`` seconds; halfway through small dies too,
  so the second half is answered by the cache alone. Reports the share answered (goal >= 99%)
  and the added latency of the degraded path (its p99 minus the warm p99);
- ``unavailable``: prompts never cached, everything down: how fast the 503 comes (goal 50 ms).
Then the latency of a fresh cache hit (``serve_fresh``) with the memory and the Redis backend.
Prints a table and writes bench/results/degrade.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
from promptlb.bench._loadgen import request_timeout
from promptlb.bench._report import RESULTS, _round, environment, write_json
from promptlb.bench._stats import percentile
from promptlb.emulator import Service, start_redis, start_service

SIDECAR = ("--sample-interval", "100ms", "--no-warmup-required", "--log-level", "WARNING")
# Each request's limit: aiohttp's default is 5 minutes, and one hung request held a phase that
# long before the gather gave up on the whole bench. The gateway's own deadlines are shorter.
TIMEOUT = request_timeout(30.0)
HEALTH = "[health]\ninterval = '250ms'\ninterval_jitter = '25ms'\ntimeout = '250ms'\n"


def body(i: int, model: str = "big") -> bytes:
    prompt = [{"role": "user", "content": f"question number {i}"}]
    return json.dumps(
        {"model": model, "messages": prompt, "max_tokens": 8, "temperature": 0}
    ).encode()


async def one(http: aiohttp.ClientSession, url: str, data: bytes) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        async with http.post(url, data=data, headers={"content-type": "application/json"}) as r:
            await r.read()
            status, how = r.status, r.headers.get("x-promptlb-degraded", "")
    except (aiohttp.ClientError, TimeoutError):  # aiohttp's timeout is no ClientError
        status, how = 0, "client_error"
    return {"status": status, "how": how, "s": time.perf_counter() - start}


async def open_loop(
    url: str,
    rate: float,
    seconds: float,
    prompts: list[int],
    rng: random.Random,
    model: str = "big",
) -> list[dict[str, Any]]:
    """Poisson arrivals at ``rate`` for ``seconds``: bounded in count and time."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        tasks = []
        start = time.perf_counter()
        t = 0.0
        i = 0
        while t < seconds and i < int(rate * seconds * 3):
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            tasks.append(
                asyncio.ensure_future(one(http, url, body(prompts[i % len(prompts)], model)))
            )
            i += 1
            t += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


def _less(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 2)


def stats(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == 200]
    lat = [r["s"] * 1000 for r in ok]
    return {
        "requests": len(results),
        "answered": len(ok),
        "share_answered": round(len(ok) / len(results), 4) if results else None,
        "by_path": {k: sum(1 for r in ok if r["how"] == k) for k in ("", "fallback", "cache")},
        "statuses": sorted({r["status"] for r in results}),
        # No answer of the kind is no figure (None), never 0 ms: a 0 read as a goal met.
        "p50_ms": _round(percentile(lat, 50), 2),
        "p99_ms": _round(percentile(lat, 99), 2),
    }


@contextlib.contextmanager
def cluster(cache: str, serve_fresh: bool = False) -> Iterator[tuple[Service, dict[str, Service]]]:
    """The gateway and its nodes, every process stopped on the way out: a service that failed
    to start left the ones started before it running."""
    started: list[Service] = []
    nodes: dict[str, Service] = {}
    tables = []
    with tempfile.TemporaryDirectory(prefix="promptlb-degrade-") as workdir:
        try:
            for name, flags in {
                "big": (
                    "--model",
                    "big",
                    "--slots",
                    "16",
                    "--ttft-ms",
                    "150",
                    "--tokens-per-s",
                    "60",
                ),
                "small": (
                    "--model",
                    "small",
                    "--slots",
                    "16",
                    "--ttft-ms",
                    "20",
                    "--tokens-per-s",
                    "300",
                ),
            }.items():
                model = start_service("emulator", *flags)
                started.append(model)
                side = start_service(
                    "sidecar", "--model-url", model.url, "--node-name", name, *SIDECAR
                )
                started.append(side)
                nodes[name] = model
                tables.append(
                    f"[[nodes]]\nname = '{name}'\nurl = '{model.url}'\nsidecar = '{side.url}'\n"
                    f"models = ['{name}']\n"
                )
            config = Path(workdir) / "promptlb.toml"
            config.write_text(
                HEALTH
                + f"[cache]\nbackend = '{cache}'\nserve_fresh = {str(serve_fresh).lower()}\n"
                + "[[fallback]]\nmodel = 'big'\nthen = ['small', 'cache']\nttft = '1s'\n"
                + "\n".join(tables)
            )
            gateway = start_service("middleware", "--config", str(config), "--log-level", "warning")
            started.append(gateway)
            yield gateway, nodes
        finally:
            for service in reversed(started):
                service.stop()


async def outage(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = list(range(args.prompts))
    with cluster("memory") as (gateway, nodes):
        url = gateway.url + "/v1/chat/completions"
        await asyncio.sleep(1.5)  # snapshots and health in
        warm = await open_loop(url, args.rate, args.warm, prompts, rng)
        # The light model asked for itself (prompts it never saw): what a fallback adds is
        # measured against this.
        light = await open_loop(url, args.rate, 5.0, [p + 10_000 for p in prompts], rng, "small")
        await asyncio.sleep(0.5)
        shuffled = prompts[:]
        rng.shuffle(shuffled)
        nodes["big"].proc.kill()
        half = args.outage / 2
        first = asyncio.ensure_future(open_loop(url, args.rate, half, shuffled, rng))
        await first
        nodes["small"].proc.kill()
        second = await open_loop(url, args.rate, half, shuffled, rng)
        await asyncio.sleep(1.0)  # every node is known down now
        unavailable = []
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            for i in range(args.prompts, args.prompts + 100):
                unavailable.append(await one(http, url, body(i)))
        whole = first.result() + second
        report: dict[str, Any] = {
            "warm": stats(warm),
            "light_direct": stats(light),
            "outage_primary_down": stats(first.result()),
            "outage_everything_down": stats(second),
            "outage": stats(whole),
        }
        lat503 = [r["s"] * 1000 for r in unavailable if r["status"] == 503]
        report["unavailable"] = {
            "requests": len(unavailable),
            "answered_503": len(lat503),
            "p50_ms": _round(percentile(lat503, 50), 2),
            "p99_ms": _round(percentile(lat503, 99), 2),
        }
        # What the degraded path adds: the fallback's p99 over the light model asked directly
        # (the failed try on the dead primary, the rewrite); and the whole outage over normal.
        fallback = report["outage_primary_down"]["p99_ms"]
        report["fallback_added_p99_ms"] = _less(fallback, report["light_direct"]["p99_ms"])
        report["outage_vs_warm_p99_ms"] = _less(
            report["outage"]["p99_ms"], report["warm"]["p99_ms"]
        )
        return report


async def hit_latency(backend: str, count: int) -> dict[str, Any]:
    """Sequential requests for one cached answer (``serve_fresh``) and the node's first one."""
    with cluster(backend, serve_fresh=True) as (gateway, _):
        url = gateway.url + "/v1/chat/completions"
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            first = await one(http, url, body(0, "small"))
            assert first["status"] == 200, first
            await asyncio.sleep(0.3)
            hits = []
            for _ in range(count):
                start = time.perf_counter()
                async with http.post(url, data=body(0, "small")) as r:
                    await r.read()
                    assert r.headers.get("x-promptlb-cache") == "hit", dict(r.headers)
                hits.append((time.perf_counter() - start) * 1000)
        return {
            "hits": count,
            "p50_ms": _round(percentile(hits, 50), 3),
            "p99_ms": _round(percentile(hits, 99), 3),
            "node_answer_ms": round(first["s"] * 1000, 2),
        }


async def cache_hits(count: int) -> dict[str, Any]:
    out: dict[str, Any] = {"memory": await hit_latency("memory", count)}
    binary = shutil.which("redis-server")
    if binary is None:
        out["redis"] = "missing: redis-server is not installed"
        return out
    with tempfile.TemporaryDirectory() as workdir:
        redis = start_redis(binary, workdir)
        try:
            out["redis"] = await hit_latency(redis.url, count)
        finally:
            redis.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--warm", type=float, default=10.0, help="seconds with every node up")
    p.add_argument("--outage", type=float, default=30.0, help="seconds with the primary down")
    p.add_argument("--prompts", type=int, default=40, help="distinct prompts in the pool")
    p.add_argument("--hits", type=int, default=500, help="sequential cache hits per backend")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON (default bench/results/degrade.json; under bench/results/quick/ for a run "
        "with any other option changed, so that it never replaces the committed full run)",
    )
    args = p.parse_args()
    if args.out is None:
        changed = any(v != p.get_default(k) for k, v in vars(args).items() if k != "out")
        args.out = RESULTS / ("quick" if changed else "") / "degrade.json"
    report: dict[str, Any] = {
        "environment": environment(),
        "params": vars(args) | {"out": str(args.out)},
    }
    report |= asyncio.run(outage(args))
    report["cache_hit"] = asyncio.run(cache_hits(args.hits))
    print(json.dumps(report, indent=1))
    write_json(args.out, report)


if __name__ == "__main__":
    main()
