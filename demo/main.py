"""`make demo`: an emulated model server and its sidecar, with live load snapshots for ~15 s.

It starts both as real processes, sends a rising wave of chat requests to the model server, drains
and undrains the node through the sidecar's control API, and prints what the sidecar reports
each second. Everything it started is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from promptlb.emulator._launch import Service, start_service
from promptlb.shared import Snapshot, decode

DURATION_S = 15.0
HEADER = (
    f"{'t':>4}  {'health':<7} {'warm':<5} {'drain':<5} {'run':>4} {'wait':>4} "
    f"{'kv':>5} {'tok/s':>6} {'cpu':>5} {'mem':>5} {'rss MiB':>8} {'MiB/s':>6} {'seq':>5}"
)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def row(t: float, health: int, s: Snapshot) -> str:
    e = s.engine
    return (
        f"{t:4.0f}  {health:<7} {s.warm!s:<5} {s.draining!s:<5} "
        f"{e.running if e else '-':>4} {e.waiting if e else '-':>4} "
        f"{pct(e.kv_cache if e else None):>5} "
        f"{(f'{e.tps:.0f}' if e and e.tps is not None else '-'):>6} "
        f"{pct(s.cpu):>5} {pct(s.mem):>5} "
        f"{(f'{s.rss / 2**20:.0f}' if s.rss else '-'):>8} "
        f"{(f'{s.rss_slope / 2**20:.1f}' if s.rss_slope is not None else '-'):>6} "
        f"{s.seq:>5}"
    )


async def load(http: aiohttp.ClientSession, model: Service, stop_at: float) -> int:
    """A wave: 1 concurrent request at first, up to 12 by the middle, then back down."""
    sent = 0
    in_flight: set[asyncio.Task[None]] = set()

    async def one() -> None:
        body = {
            "model": "llama-demo",
            "stream": True,
            "max_tokens": 60,
            "messages": [{"role": "user", "content": "Tell me about load balancing."}],
        }
        async with http.post(model.url + "/v1/chat/completions", json=body) as response:
            async for _ in response.content:
                pass

    start = time.monotonic()
    while (now := time.monotonic()) < stop_at:
        phase = (now - start) / (stop_at - start)
        target = max(1, round(12 * (1 - abs(2 * phase - 1))))
        while len(in_flight) < target:
            task = asyncio.create_task(one())
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            sent += 1
        await asyncio.sleep(0.1)
    for task in list(in_flight):
        task.cancel()
    await asyncio.gather(*in_flight, return_exceptions=True)
    return sent


async def run(workdir: Path) -> None:
    token = secrets.token_urlsafe(16)
    (workdir / "token").write_text(token)
    print("starting promptlb-emulator (4 slots, 40 tok/s, leaks 2 MB a request) ...")
    model = start_service(
        "emulator",
        "--model",
        "llama-demo",
        "--slots",
        "4",
        "--tokens-per-s",
        "40",
        "--ttft-ms",
        "80",
        "--load-time-s",
        "1",
        "--leak-mb-per-req",
        "2",
        "--seed",
        "7",
    )
    try:
        print(f"starting promptlb-sidecar beside it (model server {model.url}) ...")
        sidecar = start_service(
            "sidecar",
            "--model-url",
            model.url,
            "--node-name",
            "node-a",
            "--tier",
            "heavy",
            "--token-file",
            str(workdir / "token"),
            "--sample-interval",
            "250ms",
            "--rss-window",
            "5s",
            "--log-level",
            "WARNING",
        )
        try:
            await show(model, sidecar, token)
        finally:
            sidecar.stop()
    finally:
        model.stop()
    print("stopped the sidecar and the emulator.")


async def show(model: Service, sidecar: Service, token: str) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    print(f"sidecar on {sidecar.url}: GET /health, GET /snapshot (msgpack), GET /metrics\n")
    print(HEADER)
    async with aiohttp.ClientSession() as http:
        start = time.monotonic()
        wave = asyncio.create_task(load(http, model, start + DURATION_S - 1))
        actions = {9: ("/drain", "drain requested"), 11: ("/undrain", "undrained")}
        for second in range(int(DURATION_S) + 1):
            await asyncio.sleep(max(0.0, start + second - time.monotonic()))
            if second in actions:
                path, note = actions[second]
                async with http.post(sidecar.url + path, headers=auth) as response:
                    print(f"      -- POST {path}: {response.status}, {note}")
            async with http.get(sidecar.url + "/health") as response:
                health = response.status
            async with http.get(sidecar.url + "/snapshot") as response:
                snapshot = decode(await response.read())
            print(row(time.monotonic() - start, health, snapshot), flush=True)
        sent = await wave
    print(f"\n{sent} requests sent; health 503 while loading, warming or draining.")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="promptlb-demo-") as workdir:
        try:
            asyncio.run(run(Path(workdir)))
        except KeyboardInterrupt:
            print("interrupted; everything started was stopped.", file=sys.stderr)


if __name__ == "__main__":
    main()
