"""The fault suite's cluster and load (`_faultsuite` runs the faults): one fault after another
under steady load, with figures.

Three emulated nodes with sidecars, Redis as the cache, and ``promptlb-gateway`` in front, all
real processes on this machine. A steady load (half streamed, half not) runs throughout; each
fault is applied, held, and reverted in turn. Per fault: the requests that failed (non-streamed,
streams before their first byte, and streams cut after it with an error event), the seconds
until the gateway's status shows it (detect) and until the cluster is whole again (recover);
for the suite, the gateway's RSS growth. ``--quick`` holds each fault a few seconds (CI runs
it); the full size holds them longer and ends with 1,000 concurrent streams for ten minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from promptlb.emulator import Service, free_port, start_redis, start_service

from ._loadgen import UNREADABLE

__all__ = [
    "BODY",
    "Cluster",
    "Tally",
    "load",
    "node_states",
    "one",
    "post_fault",
    "rss_mb",
    "until",
]

NODES = ("a", "b", "c")
BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "x"}],
}


@dataclass
class Tally:
    """What the load saw while one fault was on."""

    sent: int = 0
    failed: int = 0  # non-streamed, or a stream that failed before its first byte
    broken_streams: int = 0  # cut after the first byte: ended with an error event
    statuses: dict[int, int] = field(default_factory=dict)


def _let_go(old: Service | None) -> None:
    """The process a restart replaces, stopped (if the step has not killed it) and its log
    and pipe let go: each kill-and-start of the suite left them behind."""
    if old is not None:
        old.stop()


class Cluster:
    """The processes, restartable on their own ports so that the gateway's config holds."""

    def __init__(self, workdir: Path, redis: str) -> None:
        self.workdir = workdir
        self.redis_binary = redis
        self.ports = {n: (free_port(), free_port()) for n in NODES}
        self.redis_port = free_port()
        self.models: dict[str, Service] = {}
        self.sidecars: dict[str, Service] = {}
        self.redis: Service | None = None
        self.gateway: Service | None = None

    def start_model(self, name: str) -> None:
        port = str(self.ports[name][0])
        _let_go(self.models.get(name))
        self.models[name] = start_service(
            *("emulator", "--model", "m", "--port", port, "--slots", "512"),
            *("--ttft-ms", "30", "--tokens-per-s", "400"),
            # An event every half second: 1,000 ten-minute streams are 2,000 writes a second,
            # not 20,000, on a machine the gateway shares with the nodes and the load.
            *("--stream-interval-ms", "500"),
        )

    def start_sidecar(self, name: str) -> None:
        model, port = self.ports[name]
        _let_go(self.sidecars.get(name))
        self.sidecars[name] = start_service(
            "sidecar",
            *("--port", str(port), "--model-url", f"http://127.0.0.1:{model}"),
            *("--node-name", name, "--sample-interval", "100ms", "--no-warmup-required"),
            *("--rss-window", "2s", "--memory-limit-mb", "6000", "--log-level", "WARNING"),
        )

    def start_redis(self) -> None:
        """Redis on the port the gateway's config names, also when it comes back after a kill."""
        self.redis = start_redis(self.redis_binary, str(self.workdir), port=self.redis_port)

    def kill_redis(self) -> None:
        """SIGKILL: Redis dies as it would on a crash."""
        if self.redis is not None:
            self.redis.kill()
            self.redis.stop()  # its log

    def start(self) -> None:
        self.start_redis()
        for name in NODES:
            self.start_model(name)
            self.start_sidecar(name)
        tables = "".join(
            f"[[nodes]]\nname = '{n}'\nurl = 'http://127.0.0.1:{m}'\n"
            f"sidecar = 'http://127.0.0.1:{s}'\nmodels = ['m']\n"
            for n, (m, s) in self.ports.items()
        )
        config = self.workdir / "gateway.toml"
        config.write_text(
            "admin_local_only = true\n"
            "[health]\ninterval = '250ms'\ntimeout = '250ms'\nunhealthy_threshold = 1\n"
            "[retry]\nper_try_timeout = '2s'\ntotal_timeout = '15m'\n"  # the soak's streams
            f"[cache]\nbackend = 'redis://127.0.0.1:{self.redis_port}/0'\n" + tables
        )
        self.gateway = start_service("middleware", "--config", str(config), "--log-level", "error")

    def stop(self) -> None:
        for service in [self.gateway, *self.sidecars.values(), *self.models.values()]:
            if service is not None:
                with contextlib.suppress(OSError):
                    os.kill(service.pid, signal.SIGCONT)  # a stopped process cannot exit
                service.stop()
        self.kill_redis()

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url


async def one(http: aiohttp.ClientSession, url: str, stream: bool, tally: Tally) -> None:
    tally.sent += 1
    try:
        async with http.post(url + "/v1/chat/completions", json={**BODY, "stream": stream}) as r:
            tally.statuses[r.status] = tally.statuses.get(r.status, 0) + 1
            data = await r.read()
            if r.status != 200:
                tally.failed += 1
            elif stream and b'"error"' in data:
                tally.broken_streams += 1
    except (aiohttp.ClientError, TimeoutError):
        tally.failed += 1


async def load(url: str, rate: float, stop: asyncio.Event, tally: list[Tally]) -> None:
    """Steady open-loop load, half streamed; each request counts in the tally of its time."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        tasks: set[asyncio.Task[None]] = set()
        i = 0
        while not stop.is_set():
            task = asyncio.ensure_future(one(http, url, i % 2 == 1, tally[-1]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            await asyncio.sleep(1.0 / rate)
        if tasks:
            await asyncio.wait(tasks, timeout=30)


async def node_states(http: aiohttp.ClientSession, url: str) -> dict[str, str]:
    async with http.get(url + "/_promptlb/status") as response:
        body = await response.json()
    return {n["name"]: n["state"] for n in body["nodes"]}


async def until(check: Callable[[], Awaitable[bool]], limit: float) -> float | None:
    """Seconds until ``check`` holds, polled every 50 ms; None if it never did. A check that
    cannot be read (the gateway's status slow to answer under the fault, or of another shape)
    does not hold yet: one timeout in a flood ended the whole suite and lost its report."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        try:
            held = await check()
        except UNREADABLE:
            held = False
        if held:
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    return None


def rss_mb(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 2**20


async def post_fault(http: aiohttp.ClientSession, model: Service, **faults: Any) -> None:
    async with http.post(model.url + "/_emulator/faults", json=faults) as response:
        assert response.status == 200, await response.text()
