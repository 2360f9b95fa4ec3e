"""``promptlb-bench faults``: the faults applied in order under steady load, how each is
measured, and the report (see `_faults` for the cluster and the load)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from ._faults import BODY, Cluster, Tally, load, node_states, post_fault, rss_mb, until
from ._report import RESULTS, environment, write_json

__all__ = ["SOAK", "run_faults", "selected"]

Step = Callable[[], Awaitable[None]]
Check = Callable[[], Awaitable[bool]]


@dataclass
class Fault:
    name: str
    apply: Step
    revert: Step
    detect: Check | None  # None: nothing for the gateway to see (it must keep serving)
    recover: Check


SOAK = "streams"  # what ``only`` names the closing soak by


def selected(name: str, only: Sequence[str] | None) -> bool:
    """Whether a run limited to ``only`` (parts of fault names, any case) includes ``name``."""
    return only is None or any(part.lower() in name.lower() for part in only)


def _row(
    name: str,
    held_s: float,
    seen: Tally,
    detect: float | None,
    recover: float | None,
    states: Sequence[str],
) -> dict[str, Any]:
    """One row of the report: what the load saw while ``name`` was held ``held_s`` seconds."""
    return {
        "fault": name,
        "held_s": round(held_s, 1),
        "sent": seen.sent,
        "failed": seen.failed,
        "broken_streams": seen.broken_streams,
        "statuses": dict(seen.statuses),  # a copy: late answers still come
        "detect_s": None if detect is None else round(detect, 2),
        "recover_s": None if recover is None else round(recover, 2),
        "states": list(states),
    }


async def _suite(cluster: Cluster, quick: bool, only: Sequence[str] | None) -> dict[str, Any]:
    hold = 5.0 if quick else 10.0
    rate = 20.0 if quick else 40.0
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    url = cluster.url
    # The states the faulty node went through while the suite waited to see the fault: a
    # fault not seen as expected shows what it was seen as instead.
    seen_states: list[str] = []

    async def state(name: str) -> str:
        now = (await node_states(http, url))[name]
        if not seen_states or seen_states[-1] != now:
            seen_states.append(now)
        return now

    def is_(name: str, *wanted: str) -> Check:
        async def check() -> bool:
            return await state(name) in wanted

        return check

    def all_ready() -> Check:
        async def check() -> bool:
            return set((await node_states(http, url)).values()) == {"ready"}

        return check

    async def nothing() -> None:
        return None

    def kill(service_of: Callable[[], Any]) -> Step:
        async def step() -> None:
            service_of().proc.kill()
            service_of().proc.wait(5)

        return step

    def start(fn: Callable[[], None]) -> Step:
        async def step() -> None:
            await asyncio.to_thread(fn)

        return step

    def signal_model(sig: signal.Signals) -> Step:
        async def step() -> None:
            os.kill(cluster.models["a"].pid, sig)

        return step

    def model_fault(**faults: Any) -> Step:
        async def step() -> None:
            await post_fault(http, cluster.models["a"], **faults)

        return step

    async def kill_sidecars() -> None:
        for sidecar in cluster.sidecars.values():
            sidecar.proc.kill()
            sidecar.proc.wait(5)

    async def start_sidecars() -> None:
        for name in cluster.sidecars:
            await asyncio.to_thread(cluster.start_sidecar, name)

    async def kill_redis() -> None:
        await asyncio.to_thread(cluster.kill_redis)

    async def poison_on() -> None:
        for model in cluster.models.values():
            await post_fault(http, model, poison="POISON")
        poisoned = {**BODY, "messages": [{"role": "user", "content": "POISON"}]}
        async with http.post(url + "/v1/chat/completions", json=poisoned) as response:
            await response.read()  # passed through as the nodes answered it, nobody ejected

    async def poison_off() -> None:
        for model in cluster.models.values():
            await post_fault(http, model, poison="")

    slow: list[socket.socket] = []

    async def slow_clients() -> None:
        host, port = url.removeprefix("http://").split(":")
        for _ in range(50 if quick else 150):
            s = socket.create_connection((host, int(port)))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
            slow.append(s)

    async def slow_clients_gone() -> None:
        for s in slow:
            s.close()

    faults = [
        Fault(
            "kill a node",
            kill(lambda: cluster.models["a"]),
            start(lambda: cluster.start_model("a")),
            is_("a", "unhealthy", "ejected"),
            all_ready(),
        ),
        Fault(
            "SIGSTOP a node",
            signal_model(signal.SIGSTOP),
            signal_model(signal.SIGCONT),
            is_("a", "unhealthy", "ejected"),
            all_ready(),
        ),
        Fault(
            "hang a node",
            model_fault(hang=True),
            model_fault(hang=False),
            is_("a", "unhealthy", "ejected"),
            all_ready(),
        ),
        Fault(
            "kill a sidecar",
            kill(lambda: cluster.sidecars["a"]),
            start(lambda: cluster.start_sidecar("a")),
            None,
            all_ready(),
        ),
        Fault("kill every sidecar", kill_sidecars, start_sidecars, None, all_ready()),
        Fault("kill Redis", kill_redis, start(cluster.start_redis), None, all_ready()),
        Fault(
            "a leaking node",
            model_fault(leak_mb_per_req=40),
            model_fault(leak_mb_per_req=0, free_leaked=True),
            is_("a", "leaking"),
            all_ready(),
        ),
        Fault("poison requests", poison_on, poison_off, None, all_ready()),
        Fault("a slow client flood", slow_clients, slow_clients_gone, None, all_ready()),
    ]
    if not any(selected(f.name, only) for f in faults) and not selected(SOAK, only):
        await http.close()
        raise SystemExit(f"promptlb-bench faults: --only {only} names no fault")
    assert cluster.gateway is not None
    tallies = [Tally()]
    stop = asyncio.Event()
    loading = asyncio.ensure_future(load(url, rate, stop, tallies))
    rows: list[dict[str, Any]] = []
    try:
        await asyncio.sleep(2.0)  # the load settles, and the gateway is warm
        rss_before = rss_mb(cluster.gateway.pid)
        for fault in faults:
            if not selected(fault.name, only):
                continue
            tallies.append(Tally())
            seen_states.clear()
            started = time.monotonic()
            await fault.apply()
            # Seen within 15 s, however long the hold: a loaded machine (CI) is slower to tell.
            detect = await until(fault.detect, 15.0) if fault.detect else None
            await asyncio.sleep(max(0.0, hold - (time.monotonic() - started)))
            held_s = time.monotonic() - started  # a fault never seen is held the 15 s
            await fault.revert()
            recover = await until(fault.recover, 30.0)
            await asyncio.sleep(1.0)  # what the recovery's last requests saw
            rows.append(_row(fault.name, held_s, tallies[-1], detect, recover, seen_states))
        soak_before = soak_after = rss_mb(cluster.gateway.pid)
        held: list[float] = []  # the gateway's RSS with every stream open, early and late
        if selected(SOAK, only):
            tallies.append(Tally())  # the steady load during the soak counts apart
            gateway = cluster.gateway
            assert gateway is not None

            def sample() -> None:
                held.append(rss_mb(gateway.pid))

            seconds = 5.0 if quick else 600.0
            rows.append({**await _streams(url, 200 if quick else 1000, seconds, sample)})
            rows[-1].setdefault("held_s", seconds)
            soak_after = rss_mb(cluster.gateway.pid)
            # The steady load beside the streams, reported too: it went uncounted.
            rows.append(_row(f"{SOAK}: steady load", seconds, tallies[-1], None, None, []))
    finally:
        stop.set()
        await loading
        await http.close()
    rss_after = rss_mb(cluster.gateway.pid)
    return {
        "only": None if only is None else list(only),
        "hold_s": hold,
        "rate_rps": rate,
        "faults": rows,
        # warm (after 2 s of load) to the end, and over the streams' soak alone
        "gateway_rss_mb": {"before": round(rss_before, 1), "after": round(rss_after, 1)},
        "gateway_rss_growth": round(rss_after / rss_before - 1.0, 3),
        "soak_rss_growth": round(soak_after / soak_before - 1.0, 3),
        # While every stream is open, from a tenth of the soak in to nineteen twentieths: what
        # holding them costs over time (a leak), apart from what opening them took.
        "soak_held_rss_mb": [round(mb, 1) for mb in held],
        "soak_held_growth": round(held[-1] / held[0] - 1.0, 3) if len(held) == 2 else None,
    }


async def _streams(
    url: str, count: int, seconds: float, sample: Callable[[], None] | None = None
) -> dict[str, Any]:
    """``count`` concurrent streams, each lasting about ``seconds``; ``sample`` is called a
    tenth of the way in and nineteen twentieths of the way."""
    tally = Tally()
    body = {**BODY, "max_tokens": max(8, int(400 * seconds)), "stream": True}
    timeout = aiohttp.ClientTimeout(total=seconds + 60)
    started = time.monotonic()
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:

        async def one() -> None:
            tally.sent += 1
            try:
                async with http.post(url + "/v1/chat/completions", json=body) as response:
                    data = await response.read()
                    if response.status != 200:
                        tally.failed += 1
                    elif b'"error"' in data or not data.rstrip().endswith(b"[DONE]"):
                        tally.broken_streams += 1
            except (aiohttp.ClientError, TimeoutError):
                tally.failed += 1

        async def probe() -> None:
            if sample is None:
                return
            await asyncio.sleep(seconds * 0.1)
            sample()
            await asyncio.sleep(seconds * 0.85)
            sample()

        await asyncio.gather(probe(), *(one() for _ in range(count)))
    return {
        "fault": f"{count} concurrent streams for {seconds:g}s",
        "sent": tally.sent,
        "failed": tally.failed,
        "broken_streams": tally.broken_streams,
        "seconds": round(time.monotonic() - started, 1),
    }


def run_faults(quick: bool, out: Path | None, only: Sequence[str] | None = None) -> dict[str, Any]:
    """The suite, or with ``only`` the faults whose names contain one of its parts (``streams``
    for the closing soak). A partial run writes under ``bench/results/quick/`` unless ``out``
    says otherwise: it must not replace the committed full run."""
    redis = shutil.which("redis-server")
    if redis is None:
        raise SystemExit("promptlb-bench faults: redis-server is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp), redis)
        try:
            cluster.start()
            report = asyncio.run(_suite(cluster, quick, only))
        finally:
            cluster.stop()
    result = {"benchmark": "faults", **environment(), "quick": quick, **report}
    folder = out or (RESULTS / "quick" if quick or only is not None else RESULTS)
    write_json(folder / "faults.json", result)
    return result
