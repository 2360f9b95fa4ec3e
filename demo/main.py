"""`make demo`: the three-node story, end to end, on real processes.

- node-a: heavy and GPU-like: 2 slots, slow; it saturates.
- node-b: light: 16 slots, fast; mostly idle under round robin.
- node-c: leaks memory with every request, then crashes.

Every phase runs with the fallback chain ``llama-demo -> [llama-mini, cache]`` (node-b also
serves the lighter llama-mini) and a memory response cache; the table counts the answers that
came from a fallback or the cache. A last, short phase kills every node: answers seen before
come from the cache, the rest get a quick 503.

Each node is an emulated model server with its sidecar. The example Starlette app mounts the
middleware; a traffic generator sends the same seeded open-loop traffic three times, with
`round_robin`, `p2c` and `predictive`, showing a live table; then a model-aware phase sends
questions, code and poems that the rules-based classifier routes to the nodes tagged for
them; then a summary. It ends with the cluster up again and the live dashboard's URL and
admin token printed, for 20 s of traffic (``--keep-up``, or ``make demo-up``: until Ctrl-C).
It stops everything it started, also on Ctrl-C.
"""

# Over 350 lines: one script telling one story, phase after phase, over one cluster it starts
# and stops; its pieces (the table, the phases, the traffic) are read in that order.

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from promptlb.emulator import Service, start_command, start_service

ROOT = Path(__file__).resolve().parents[1]
PHASE_S = 15.0
DASHBOARD_S = 20.0  # the closing dashboard phase, unless --keep-up
RATE = 7.0  # requests per second, Poisson
NODES = {
    "node-a": ("--slots", "2", "--tokens-per-s", "40", "--ttft-ms", "250"),
    "node-b": (
        "--slots",
        "16",
        "--tokens-per-s",
        "150",
        "--ttft-ms",
        "40",
        "--model",
        "llama-mini",
    ),
    "node-c": (
        "--slots",
        "8",
        "--tokens-per-s",
        "100",
        "--ttft-ms",
        "60",
        "--leak-mb-per-req",
        "4",
        "--crash-after",
        "25",
    ),
}


@dataclass
class Phase:
    strategy: str
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: int = 0
    sent: int = 0
    degraded: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    why: list[str] = field(default_factory=list)
    placed: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )  # prompt class -> node -> answers

    def all_latencies(self) -> list[float]:
        return [x for values in self.latencies.values() for x in values]


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def arrivals(seed: int, duration: float = PHASE_S) -> list[tuple[float, int]]:
    """The same trace for every phase: (offset s, max_tokens), heavy-tailed lengths."""
    rng = random.Random(seed)
    out: list[tuple[float, int]] = []
    t = 0.0
    while True:
        t += rng.expovariate(RATE)
        if t >= duration - 2:
            return out
        out.append((t, min(120, max(8, int(rng.lognormvariate(3.2, 0.6))))))


# The model-aware phase: prompts the rules-based classifier puts in three classes, and where
# each class should go (tags given to the nodes in every phase's config).
PROMPTS = [
    ("simple_qa", "What is the capital of Peru?"),
    ("code", "Write a Python function that parses a JSON file and fix its bug."),
    ("creative", "Write a short poem about the sea at night."),
    ("simple_qa", "How many legs does a spider have?"),
]
TAGS = {"node-a": ["creative"], "node-b": ["light"], "node-c": ["code"]}
ROUTES = (
    "[strategy_options]\ninner = 'predictive'\n"
    "[strategy_options.routes]\nsimple_qa = ['light']\ncode = ['code']\ncreative = ['creative']\n"
)
DEFAULT_PROMPT = [("", "Explain load balancing briefly.")]


async def traffic(
    http: aiohttp.ClientSession,
    app: Service,
    phase: Phase,
    duration: float,
    prompts: list[tuple[str, str]] = DEFAULT_PROMPT,
) -> None:
    start = time.monotonic()

    async def one(i: int, at: float, max_tokens: int) -> None:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        label, text = prompts[i % len(prompts)]
        body = {
            "model": "llama-demo",
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}],
            "temperature": 0,  # repeatable answers: the cache may keep them
        }
        began = time.monotonic()
        phase.sent += 1
        try:
            async with http.post(app.url + "/v1/chat/completions", json=body) as response:
                await response.read()
                how = response.headers.get("x-promptlb-degraded")
                if how is not None:
                    phase.degraded[how] += 1
                if response.status != 200:
                    phase.degraded[str(response.status)] += 1
                    phase.errors += 1
                    phase.why.append(f"{response.status} {(await response.text())[:160]}")
                    return
                node = response.headers["x-promptlb-node"]
                phase.latencies[node].append(time.monotonic() - began)
                if label:
                    phase.placed[label][node] += 1
        except aiohttp.ClientError as exc:
            phase.errors += 1
            phase.why.append(f"{type(exc).__name__}: {exc}")

    trace = arrivals(seed=42, duration=duration)
    await asyncio.gather(*(one(i, at, n) for i, (at, n) in enumerate(trace)))


async def table(http: aiohttp.ClientSession, app: Service, phase: Phase, start: float) -> None:
    async with http.get(app.url + "/_promptlb/status") as response:
        status: dict[str, Any] = await response.json()
    degraded = phase.degraded
    print(
        f"\n[{phase.strategy}] t={time.monotonic() - start:4.1f}s  sent {phase.sent}, "
        f"errors {phase.errors}; fallback {degraded['fallback']}, cache {degraded['cache']}, "
        f"503 {degraded['503']}"
    )
    print(
        f"  {'node':<7} {'state':<10} {'queue':>5} {'in-fl':>5} {'picks':>5} "
        f"{'p50 ms':>7} {'p99 ms':>7}"
    )
    for node in status["nodes"]:
        queue = node["load"]["engine_queue"]
        lat = phase.latencies.get(node["name"], [])
        shown = "-" if queue is None else str(queue)  # the engine's running + waiting
        print(
            f"  {node['name']:<7} {node['state']:<10} {shown:>5} "
            f"{node['in_flight']:>5} {len(lat):>5} {pct(lat, 0.5) * 1e3:>7.0f} "
            f"{pct(lat, 0.99) * 1e3:>7.0f}"
        )


async def run_phase(
    strategy: str,
    models: dict[str, Service],
    sidecars: dict[str, Service],
    workdir: Path,
    *,
    label: str = "",
    duration: float = PHASE_S,
    kill_all: bool = False,
    prompts: list[tuple[str, str]] = DEFAULT_PROMPT,
) -> Phase:
    config = workdir / f"{strategy}.toml"
    config.write_text(config_text(strategy, models, sidecars))
    app = start_command(
        "example-app", [str(ROOT / "examples" / "app.py"), "--config", str(config), "--port", "0"]
    )
    phase = Phase(label or strategy)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            if kill_all:
                # Seed the cache with the answers of a short, healthy warm-up, then take every
                # node down and wait for the health checks to see it.
                await traffic(http, app, Phase("warm-up"), 6.0)
                for model in models.values():
                    model.proc.kill()
                    model.proc.wait(timeout=5)
                await asyncio.sleep(2.5)
            start = time.monotonic()
            load = asyncio.create_task(traffic(http, app, phase, duration, prompts))
            while not load.done():
                await asyncio.wait({load}, timeout=3.0)
                await table(http, app, phase, start)
            await load
    finally:
        app.stop()
    return phase


def config_text(
    strategy: str, models: dict[str, Service], sidecars: dict[str, Service], head: str = ""
) -> str:
    return (
        head
        + f"strategy = '{strategy}'\nadmin_local_only = true\ngossip_interval = '500ms'\n"
        + (ROUTES if strategy == "model_aware" else "")
        + "[health]\ninterval = '1s'\ntimeout = '500ms'\n"
        "[retry]\nper_try_timeout = '20s'\n"
        "[cache]\nbackend = 'memory'\n"
        "[[fallback]]\nmodel = 'llama-demo'\nthen = ['llama-mini', 'cache']\nttft = '4s'\n"
        + "".join(
            f"[[nodes]]\nname = '{n}'\nurl = '{models[n].url}'\nsidecar = '{sidecars[n].url}'\n"
            f"tags = {TAGS[n]!r}\n"
            for n in NODES
        )
    )


def start_model(name: str, port: int = 0) -> Service:
    argv = [
        "-m",
        "promptlb.emulator",
        "--port",
        str(port),
        "--model",
        "llama-demo",
        "--seed",
        "7",
        *NODES[name],
    ]
    return start_command("emulator", argv)


async def dashboard(
    models: dict[str, Service], sidecars: dict[str, Service], workdir: Path, keep_up: bool
) -> None:
    """The cluster again, with the dashboard open and traffic flowing: DASHBOARD_S seconds,
    or until Ctrl-C with ``keep_up``."""
    for name in NODES:
        if models[name].proc.poll() is not None:
            models[name] = start_model(name, models[name].port)
    token = secrets.token_urlsafe(16)
    config = workdir / "dashboard.toml"
    config.write_text(config_text("predictive", models, sidecars, f"admin_token = '{token}'\n"))
    app = start_command(
        "example-app", [str(ROOT / "examples" / "app.py"), "--config", str(config), "--port", "0"]
    )
    until = "Ctrl-C stops it" if keep_up else f"up for {DASHBOARD_S:.0f} s (make demo-up keeps it)"
    print(
        f"\n=== the live dashboard: {app.url}/_promptlb/  admin token: {token} ===\n"
        f"  predictive, with traffic flowing; {until}"
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            start = time.monotonic()
            while keep_up or time.monotonic() - start < DASHBOARD_S:
                await traffic(http, app, Phase("dashboard"), 10.0)
    finally:
        app.stop()


async def main_async(workdir: Path, keep_up: bool = False) -> None:
    models: dict[str, Service] = {}
    sidecars: dict[str, Service] = {}
    try:
        print("starting 3 emulated model nodes, each with its sidecar ...")
        for name in NODES:
            models[name] = start_model(name)
            sidecars[name] = start_service(
                "sidecar",
                "--model-url",
                models[name].url,
                "--node-name",
                name,
                "--sample-interval",
                "250ms",
                "--no-warmup-required",
                "--no-warmup-at-start",
                "--log-level",
                "ERROR",
            )
        phases = []
        for strategy in ("round_robin", "p2c", "predictive"):
            print(
                f"\n=== {strategy}: {PHASE_S:.0f} s of the same traffic "
                f"(~{RATE:.0f} req/s; node-c crashes after 25 requests) ==="
            )
            if models["node-c"].proc.poll() is not None:
                models["node-c"] = start_model("node-c", models["node-c"].port)  # a fresh node-c
            phases.append(await run_phase(strategy, models, sidecars, workdir))
        print(
            "\n=== model_aware: questions to the light node-b, code to node-c, poems to node-a "
            "(classified by rules from the prompt text) ==="
        )
        if models["node-c"].proc.poll() is not None:
            models["node-c"] = start_model("node-c", models["node-c"].port)
        aware = await run_phase(
            "model_aware", models, sidecars, workdir, duration=10.0, prompts=PROMPTS
        )
        phases.append(aware)
        print("\n=== every node down: cached answers where there is one, else a quick 503 ===")
        if models["node-c"].proc.poll() is not None:
            models["node-c"] = start_model("node-c", models["node-c"].port)
        phases.append(
            await run_phase(
                "p2c", models, sidecars, workdir, label="all-down", duration=8.0, kill_all=True
            )
        )
        print(
            "\n=== summary: the same trace under three strategies, model-aware, every node down ==="
        )
        print(
            f"  {'phase':<12} {'requests':>8} {'errors':>6} {'p50 ms':>7} {'p99 ms':>7}"
            "   share a/b/c  fallback cache"
        )
        for phase in phases:
            lat = phase.all_latencies()
            share = "/".join(str(len(phase.latencies.get(n, []))) for n in NODES)
            median = statistics.median(lat) if lat else float("nan")
            print(
                f"  {phase.strategy:<12} {phase.sent:>8} {phase.errors:>6} "
                f"{median * 1e3:>7.0f} {pct(lat, 0.99) * 1e3:>7.0f}   {share:<11}"
                f"  {phase.degraded['fallback']:>8} {phase.degraded['cache']:>5}"
            )
        print("\n  model_aware: where each class of prompt was answered")
        for label, nodes in sorted(aware.placed.items()):
            where = ", ".join(f"{n} {c}" for n, c in sorted(nodes.items()))
            print(f"  {label:<12} {where}")
        for phase in phases:
            for why in phase.why[:3]:
                print(f"  {phase.strategy} error: {why}")
        await dashboard(models, sidecars, workdir, keep_up)
    finally:
        for service in [*sidecars.values(), *models.values()]:
            service.stop()
    print("\nstopped every process the demo started.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--keep-up", action="store_true", help="keep the cluster and its dashboard up until Ctrl-C"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="promptlb-demo-") as workdir:
        try:
            asyncio.run(main_async(Path(workdir), args.keep_up))
        except KeyboardInterrupt:
            print("interrupted; everything started was stopped.", file=sys.stderr)


if __name__ == "__main__":
    main()
