"""``promptlb-bench cluster SCENARIO``: the scenario's nodes as real processes (one emulator and
one sidecar each), then one gateway per strategy and each peer in turn, all replaying the same
seeded open-loop trace with the scenario's faults played at their times.

Between runs, crashed nodes are started again on their port and every live fault is reset (and
every emulator restarted, caches empty, where prompts or prefill times make a cache count), so
that each strategy starts from the same cluster. Every process started is stopped at the end,
on errors and on Ctrl-C too.
"""
# Over 350 lines: one run's lifecycle (start the cluster, play the trace and the faults,
# collect) shares the cluster's state throughout; the report is `_livereport`.

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from promptlb.emulator import Service, start_command, start_redis, start_service
from promptlb.middleware._strategies import STRATEGIES
from promptlb.shared import ConfigError, parse_duration

from . import _livecache, _peers
from ._livereport import Run, build_report, publish
from ._loadgen import CLASS_HEADER, UNREADABLE, Progress, Result, replay
from ._peers import Target
from ._report import CRASH_WINDOW_S, RESULTS
from ._scenario import (
    RSS_WINDOW_S,
    SLOW_FACTOR,
    Arrival,
    Fault,
    NodeSpec,
    Scenario,
    load_scenario,
    scaled,
)

__all__ = ["Cluster", "run_cluster", "scaled"]

REQUEST_TIMEOUT_S = 60.0  # each request, whoever serves it
DRAIN_S = 60.0  # after the trace's last send: time left to the requests still in flight
HEALTH_INTERVAL = "1s"
SAMPLE_INTERVAL = "250ms"
RSS_WINDOW = f"{RSS_WINDOW_S:g}s"  # the sidecars' RSS slope window (`_scenario.RSS_WINDOW_S`)
STATE_POLL_S = 0.5  # how often a run reads its gateway's node states (drains, ejections)
READY_TIMEOUT_S = 30.0


@dataclass
class LiveNode:
    spec: NodeSpec
    model: Service
    sidecar: Service
    argv: list[str]  # the emulator's command line without --port

    @property
    def alive(self) -> bool:
        return self.model.proc.poll() is None


@dataclass
class Cluster:
    """The scenario's nodes as processes; it owns them and stops them all."""

    scenario: Scenario
    nodes: dict[str, LiveNode] = field(default_factory=dict)
    # Every process ever started, recorded the moment it listens: Ctrl-C during a start or a
    # restart (in a worker thread) must still find it. Stopping twice is harmless.
    services: list[Service] = field(default_factory=list)
    stopping: bool = False
    # One restart of a node at a time: a recover's restart runs on in its thread when its run
    # ends (cancelling the task does not stop the thread), and the next run's reset started
    # the same node on the same port beside it; one of the two failed to listen.
    _restarting: dict[str, threading.Lock] = field(default_factory=dict)

    def _track(self, service: Service) -> Service:
        self.services.append(service)
        if self.stopping:  # started after stop() began: do not outlive the run
            service.stop()
            raise RuntimeError("the cluster is stopping")
        return service

    def start(self) -> None:
        specs = self.scenario.nodes
        argvs = {
            spec.name: [
                "-m",
                "promptlb.emulator",
                "--model",
                self.scenario.model,
                "--seed",
                str(self.scenario.seed * 1000 + i),
                "--log-level",
                "ERROR",
                *spec.emulator_flags(),
            ]
            for i, spec in enumerate(specs)
        }

        def model(argv: list[str]) -> Service:
            return self._track(start_command("emulator", [*argv, "--port", "0"]))

        # Started side by side: a Python process takes about a second to import and listen.
        with ThreadPoolExecutor(max_workers=8) as pool:
            models = dict(zip(argvs, pool.map(model, argvs.values()), strict=True))
            sidecars = dict(
                zip(
                    argvs,
                    pool.map(lambda s: self._track(self._sidecar(s, models[s.name])), specs),
                    strict=True,
                )
            )
        for spec in specs:
            self.nodes[spec.name] = LiveNode(
                spec, models[spec.name], sidecars[spec.name], argvs[spec.name]
            )

    @staticmethod
    def _sidecar(spec: NodeSpec, model: Service) -> Service:
        return start_service("sidecar", *sidecar_args(spec, model.url))

    def stop(self) -> None:
        self.stopping = True
        for service in reversed(self.services):
            with contextlib.suppress(Exception):
                service.stop()

    @property
    def urls(self) -> dict[str, str]:
        return {name: node.model.url for name, node in self.nodes.items()}

    @property
    def slots(self) -> dict[str, int]:
        return {name: node.spec.slots for name, node in self.nodes.items()}

    def crash(self, name: str) -> None:
        """A crash, not a shutdown: SIGKILL, connections reset mid-stream."""
        node = self.nodes[name]
        if node.alive:
            node.model.proc.kill()
            node.model.proc.wait(timeout=5)

    def restart(self, name: str) -> None:
        """The node's emulator again, on the port its sidecar and every router point at."""
        with self._restarting.setdefault(name, threading.Lock()):  # (setdefault: atomic)
            node = self.nodes[name]
            self.crash(name)
            port = str(node.model.port)
            node.model = self._track(start_command("emulator", [*node.argv, "--port", port]))

    async def set_faults(
        self, http: aiohttp.ClientSession, name: str, body: dict[str, Any]
    ) -> None:
        url = self.nodes[name].model.url + "/_emulator/faults"
        async with http.post(url, json=body) as response:
            if response.status != 200:
                why = (await response.text())[:300]  # the emulator's error names the key
                raise RuntimeError(f"{name}: faults {body} -> {response.status}: {why}")

    async def apply(self, http: aiohttp.ClientSession, name: str, fault: Fault) -> None:
        if fault.kind == "crash":
            self.crash(name)
        elif fault.kind == "recover":
            if self.nodes[name].alive:
                await self.set_faults(http, name, _RESET)
            else:
                await asyncio.to_thread(self.restart, name)  # the trace goes on meanwhile
        elif fault.kind == "slow":
            await self.set_faults(http, name, {"slow_factor": fault.value or SLOW_FACTOR})
        elif fault.kind == "hang":
            await self.set_faults(http, name, {"hang": True})
        elif fault.kind == "leak":
            await self.set_faults(http, name, {"leak_mb_per_req": fault.value})

    async def reset(self, http: aiohttp.ClientSession) -> None:
        """Every node as it started: dead ones started again, live faults off, leaks freed,
        nothing in flight."""
        for name, node in self.nodes.items():
            if not node.alive:
                await asyncio.to_thread(self.restart, name)
            await self.set_faults(http, name, {**_RESET, "free_leaked": True})
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            busy = [n for n in self.nodes if await self._in_flight(http, n) > 0]
            if not busy:
                return
            await asyncio.sleep(0.2)

    async def _in_flight(self, http: aiohttp.ClientSession, name: str) -> float:
        url = self.nodes[name].model.url + "/metrics"
        total = 0.0
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with http.get(url) as response:
                for line in (await response.text()).splitlines():
                    if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                        total += float(line.rsplit(" ", 1)[1])
        return total


def sidecar_args(spec: NodeSpec, model_url: str) -> list[str]:
    """A node's sidecar command line: its model, its labels, and the memory limit its model
    server runs under when the scenario gives one (its time to OOM is projected against it)."""
    flags = ["--tier", spec.tier] if spec.tier else []
    if spec.tags:
        flags += ["--tags", ",".join(spec.tags)]
    if spec.memory_limit_mb is not None:
        flags += ["--memory-limit-mb", str(spec.memory_limit_mb)]
    return [
        "--model-url",
        model_url,
        "--node-name",
        spec.name,
        "--sample-interval",
        SAMPLE_INTERVAL,
        "--rss-window",
        RSS_WINDOW,
        "--no-warmup-required",
        "--no-warmup-at-start",
        "--no-gpu",  # the emulators are CPU processes; a real GPU here would mislead
        "--log-level",
        "ERROR",
        *flags,
    ]


_RESET: dict[str, Any] = {"slow_factor": 1.0, "hang": False, "leak_mb_per_req": 0.0}


def gateway_config(strategy: str, cluster: Cluster, redis_url: str | None = None) -> str:
    """The gateway's TOML: the nodes with their sidecars, the strategy, 1 s health checks and
    everything else (retries, outlier ejection, slow start) at its default; ``[index_share]``
    on ``redis_url`` when given."""
    tables = "".join(
        f"\n[[nodes]]\nname = '{name}'\nurl = '{node.model.url}'\n"
        f"sidecar = '{node.sidecar.url}'\nmodels = ['{cluster.scenario.model}']\n"
        for name, node in cluster.nodes.items()
    )
    # The load generator names each request's class in a header: the gateway trusts it, as it
    # would an edge that classified the prompt (the bench's prompts are filler text).
    inner = _livecache.inner_strategy(strategy)  # "X+affinity": X under [affinity]
    head = f"strategy = '{inner}'\nadmin_local_only = true\nclass_header = '{CLASS_HEADER}'\n"
    options = cluster.scenario.strategy_options.get(inner)
    if options:
        head += f"strategy_options = {_toml_inline(options)}\n"
    health = f"\n[health]\ninterval = '{HEALTH_INTERVAL}'\n"
    sharing = _livecache.share_table(redis_url)
    return head + health + _livecache.affinity_table(strategy) + sharing + tables


def _toml_inline(value: Any) -> str:
    """A TOML inline value: JSON's strings, numbers and lists are TOML's, tables differ."""
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{json.dumps(k)} = {_toml_inline(v)}" for k, v in value.items()) + "}"
        )
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_inline(v) for v in value) + "]"
    return json.dumps(value)


def start_gateway(strategy: str, cluster: Cluster, workdir: Path, replicas: int = 1) -> Target:
    """One gateway; for an ``X+shared`` run, ``replicas`` of them sharing through a Redis
    started for the run (all stopped by the target's ``stop``)."""
    redis: Service | None = None
    if _livecache.shares(strategy):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: a +shared run needs one")
        redis = start_redis(binary, str(workdir))
    services: list[Service] = []

    def stop() -> None:
        for service in [*services, *([redis] if redis is not None else [])]:
            service.stop()

    try:
        path = workdir / f"gateway-{strategy}.toml"
        config = gateway_config(strategy, cluster, redis.url if redis is not None else None)
        path.write_text(config, encoding="utf-8")
        for _ in range(replicas if redis is not None else 1):
            argv = ("--config", str(path), "--log-level", "warning")
            services.append(start_service("middleware", *argv))
    except BaseException:
        stop()
        raise
    return Target(
        name=f"promptlb {strategy}",
        kind="promptlb",
        strategy=strategy,
        url=services[0].url,
        stop=stop,
        log=lambda: "\n".join(service.log() for service in services),
        urls=[service.url for service in services],
    )


async def wait_ready(http: aiohttp.ClientSession, target: Target, count: int) -> None:
    """A gateway is measured once it sees every node ready with a trusted snapshot: a run must
    not start while the strategy is still blind."""
    if target.kind != "promptlb":
        return
    deadline = time.monotonic() + READY_TIMEOUT_S
    seen: Any = None
    for url in target.bases:  # every replica of a +shared run
        while True:
            # (KeyError, TypeError: a 200 of another shape, a gateway still coming up behind
            # something else: asked again, not the run lost.)
            with contextlib.suppress(*UNREADABLE):
                async with http.get(url + "/_promptlb/status") as response:
                    seen = await response.json()
                nodes = seen["nodes"]
                if len(nodes) == count and all(
                    n["state"] == "ready" and n["snapshot_trusted"] for n in nodes
                ):
                    break
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{target.name}: nodes not all ready after {READY_TIMEOUT_S:g}s: {seen}"
                )
            await asyncio.sleep(0.2)


class ProgressBar:
    """A plain-text bar on stderr, redrawn with ``\\r`` on a terminal; elsewhere (a log, CI)
    one line every few seconds."""

    def __init__(self, label: str, duration: float, progress: Progress) -> None:
        self.label, self.duration, self.progress = label, duration, progress
        self.tty = sys.stderr.isatty()

    def line(self, now: float) -> str:
        p = self.progress
        elapsed = now - p.started_at if p.started_at else 0.0
        share = min(1.0, elapsed / self.duration) if self.duration else 1.0
        bar = "#" * round(share * 24) + "-" * (24 - round(share * 24))
        tail = f" draining {p.sent - p.done}" if elapsed > self.duration else ""
        return (
            f"  {self.label:<30} [{bar}] {min(elapsed, self.duration):5.1f}/{self.duration:g}s "
            f"sent {p.sent}/{p.total} done {p.done} err {p.errors}{tail}"
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        period = 0.25 if self.tty else 5.0
        while True:
            await asyncio.sleep(period)
            if self.tty:
                sys.stderr.write("\r" + self.line(loop.time()).ljust(110))
            else:
                sys.stderr.write(self.line(loop.time()) + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        end = "\r" if self.tty else ""
        sys.stderr.write(end + self.line(loop.time()).ljust(110 if self.tty else 0) + "\n")
        sys.stderr.flush()


async def watch_states(
    http: aiohttp.ClientSession,
    url: str,
    clock: Callable[[], float],
    into: dict[str, list[list[Any]]],
) -> None:
    """Poll a gateway's ``/_promptlb/status`` and note each node's state when it changes
    (``leaking``: drained for a projected OOM), to within ``STATE_POLL_S``."""
    last: dict[str, str] = {}
    while True:
        with contextlib.suppress(*UNREADABLE):  # another shape this once: asked again
            async with http.get(url + "/_promptlb/status") as response:
                doc = await response.json()
            t = round(clock(), 2)
            for node in doc["nodes"]:
                name, state = str(node["name"]), str(node["state"])
                if last.get(name) != state:
                    last[name] = state
                    into.setdefault(name, []).append([t, state])
        await asyncio.sleep(STATE_POLL_S)


async def play_faults(
    schedule: Sequence[tuple[float, str, Fault]],
    duration: float,
    start: float,
    apply: Callable[[str, Fault], Awaitable[None]],
    applied: list[dict[str, Any]],
) -> None:
    """Each ``(at, node, fault)`` applied at loop time ``start + at`` (none past ``duration``:
    nothing is left to see it), what happened appended to ``applied``. A task per node, each
    in its node's order (a crash reads whether the node is alive): played in one, a recover's
    restart (seconds) held every other node's faults back."""
    loop = asyncio.get_running_loop()

    async def play(faults: Sequence[tuple[float, str, Fault]]) -> None:
        for at, name, fault in faults:
            if at >= duration:
                break
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            began = loop.time() - start
            try:
                await apply(name, fault)
                outcome = "ok"
            except Exception as exc:  # reported, and the run goes on: a benchmark, not a test
                outcome = f"failed: {exc}"
            applied.append(
                {
                    "node": name,
                    "kind": fault.kind,
                    "value": fault.value,
                    "at": round(at, 3),
                    "applied_at": round(began, 3),
                    "outcome": outcome,
                }
            )

    per_node: dict[str, list[tuple[float, str, Fault]]] = {}
    for entry in sorted(schedule, key=lambda x: x[0]):
        per_node.setdefault(entry[1], []).append(entry)
    await asyncio.gather(*(play(faults) for faults in per_node.values()))


async def measure(
    http: aiohttp.ClientSession, cluster: Cluster, target: Target, trace: Sequence[Arrival]
) -> Run:
    """One replay of the trace through ``target``, the faults played on the same clock."""
    scenario = cluster.scenario
    schedule = [(f.at, name, f) for name, n in cluster.nodes.items() for f in n.spec.faults]
    applied: list[dict[str, Any]] = []
    states: dict[str, list[list[Any]]] | None = {} if target.kind == "promptlb" else None
    prompted = any(a.messages for a in trace)
    kv_use: dict[str, list[list[float]]] | None = {} if prompted else None
    progress = Progress()
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []

    def clock() -> float:
        return loop.time() - progress.started_at

    def on_start() -> None:
        playing = play_faults(
            schedule,
            scenario.duration,
            progress.started_at,
            functools.partial(cluster.apply, http),
            applied,
        )
        tasks.append(asyncio.create_task(playing, name="the faults"))
        if states is not None:
            watch = watch_states(http, target.url, clock, states)
            tasks.append(asyncio.create_task(watch, name="the node-state watch"))
        if kv_use is not None:
            watch = _livecache.watch_kv(http, cluster.urls, clock, kv_use)
            tasks.append(asyncio.create_task(watch, name="the KV-use watch"))

    bar = ProgressBar(target.name, scenario.duration, progress)
    drawing = asyncio.create_task(bar.run())
    try:
        results = await replay(
            target.bases,
            trace,
            model=scenario.model,
            timeout_s=REQUEST_TIMEOUT_S,
            drain_s=DRAIN_S,
            upstreams=target.upstreams,
            progress=progress,
            on_start=on_start,
        )
    finally:
        for task in [drawing, *tasks]:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # a watcher's end: the replay's results still stand
                print(f"\n{target.name}: {task.get_name()} ended: {exc!r}", file=sys.stderr)
        bar.close()
    applied.sort(key=lambda a: (a["at"], a["node"]))  # the nodes' tasks finish in any order
    return Run(target.name, target.kind, target.strategy, results, applied, states, kv_use)


@dataclass
class Plan:
    """What to run: our strategies, then each peer's strategies; what is missing, and why."""

    ours: list[str]
    peers: list[tuple[str, str]]  # (peer, strategy)
    missing: list[str]
    replicas: int = 8  # gateways of a +shared run


def plan(strategies: str, peers: str) -> Plan:
    # Named twice, a run ran twice and the second's results replaced the first's unsaid.
    ours = list(dict.fromkeys(s.strip() for s in strategies.split(",") if s.strip()))
    known = tuple(STRATEGIES)
    for s in ours:
        if not _livecache.known(s):
            raise ConfigError(
                "strategies",
                s,
                "one of " + ", ".join(known) + " (or X+affinity, X+shared, X+affinity+shared)",
            )
    wanted = list(dict.fromkeys(p.strip() for p in peers.split(",") if p.strip() != "none"))
    wanted = [p for p in wanted if p]
    if not ours and not wanted:
        # Nothing to run: the whole cluster started, ran nothing and wrote nothing.
        raise ConfigError("strategies", strategies, "at least one strategy or peer to run")
    runs: list[tuple[str, str]] = []
    missing: list[str] = []
    for peer in wanted:
        if peer == "nginx":
            why = _peers.nginx_missing()
            strategies_of: Sequence[str] = _peers.NGINX_STRATEGIES
        elif peer == "litellm":
            why = _peers.litellm_missing()
            strategies_of = _peers.LITELLM_STRATEGIES
        elif peer == "oracle":  # the emulators answer it: never missing
            why, strategies_of = None, ("oracle",)
        else:
            raise ConfigError("peers", peer, "nginx, litellm, oracle or none")
        if why:
            missing.append(f"missing: {why}")
        else:
            runs += [(peer, s) for s in strategies_of]
    return Plan(ours, runs, missing)


def _start_target(
    kind: str, strategy: str, cluster: Cluster, workdir: Path, replicas: int = 1
) -> Target:
    if kind == "promptlb":
        return start_gateway(strategy, cluster, workdir, replicas)
    if kind == "nginx":
        return _peers.start_nginx(strategy, cluster.urls)
    if kind == "oracle":
        return _peers.start_oracle(cluster.urls)
    return _peers.start_litellm(strategy, cluster.urls, cluster.scenario.model)


async def run_all(
    scenario: Scenario, chosen: Plan, meta: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, list[Result]]]:
    """Every run, then the report; the results per run too, for the plot."""
    # SIGTERM cancels the run as Ctrl-C does (the loop's runner handles SIGINT), unwinding
    # through every finally that stops a process.
    me = asyncio.current_task()
    assert me is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, me.cancel)
    trace = scenario.arrivals()
    prompted = any(a.messages for a in trace)
    cold = _livecache.starts_cold(prompted, (n.prefill_tokens_per_s for n in scenario.nodes))
    hits: dict[str, float | None] = {}
    cluster = Cluster(scenario)
    started: list[Target] = []
    runs: dict[str, Run] = {}
    failed: dict[str, str] = {}
    print(
        f"{scenario.name}: {len(scenario.nodes)} nodes, {len(trace)} requests in "
        f"{scenario.duration:g}s ({len(trace) / scenario.duration:.1f}/s offered, "
        f"{scenario.capacity():.1f}/s capacity)",
        file=sys.stderr,
    )
    for line in chosen.missing:
        print(f"  {line}", file=sys.stderr)
    try:
        cluster.start()  # blocking is fine: nothing else runs yet, and Ctrl-C lands here
        with tempfile.TemporaryDirectory(prefix="promptlb-bench-") as tmp:
            timeout = aiohttp.ClientTimeout(total=10)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                todo = [("promptlb", s) for s in chosen.ours] + chosen.peers
                for kind, strategy in todo:
                    name = kind if kind == strategy else f"{kind} {strategy}"
                    try:
                        if cold:  # every router starts on cold caches
                            await asyncio.to_thread(_livecache.restart_all, cluster)
                        await cluster.reset(http)
                    except Exception as exc:  # this run is lost, not the ones already done
                        failed[name] = f"the cluster could not be reset: {exc}"[:2000]
                        print(f"  {name}: {failed[name][:300]}", file=sys.stderr)
                        continue
                    starting = asyncio.ensure_future(
                        asyncio.to_thread(
                            _start_target, kind, strategy, cluster, Path(tmp), chosen.replicas
                        )
                    )
                    try:
                        target = await asyncio.shield(starting)
                    except asyncio.CancelledError:
                        # The thread goes on starting it (nginx is no Service that the exit
                        # stops): wait for it, for the finally below to stop it too, through
                        # a second cancel as well.
                        while not starting.done():
                            with contextlib.suppress(asyncio.CancelledError):
                                await asyncio.shield(starting)
                        if not starting.cancelled() and starting.exception() is None:
                            started.append(starting.result())
                        raise
                    except Exception as exc:  # a peer that fails to start is reported, not fatal
                        failed[name] = f"did not start: {exc}"[:2000]
                        print(f"  {name}: {failed[name][:300]}", file=sys.stderr)
                        continue
                    started.append(target)
                    try:
                        await wait_ready(http, target, len(cluster.nodes))
                        before = await _livecache.kv_counts(http, cluster.urls)
                        runs[name] = await measure(http, cluster, target, trace)
                        if _livecache.shares(strategy):
                            lag = await _livecache.share_lag(http, target.bases)
                            runs[name].share_lag = lag
                        after = await _livecache.kv_counts(http, cluster.urls)
                        hits[name] = (
                            _livecache.hit_rate(before, after, cluster.urls) if prompted else None
                        )
                    except Exception as exc:  # an interrupt (BaseException) still ends it all
                        failed[name] = f"{type(exc).__name__}: {exc}"[:2000]
                        print(f"  {name}: {failed[name][:300]}", file=sys.stderr)
                    finally:
                        target.stop()
                        started.remove(target)
                with contextlib.suppress(Exception):  # the runs are done: their report stands
                    await cluster.reset(http)
    finally:
        for target in started:
            with contextlib.suppress(Exception):
                target.stop()
        await asyncio.to_thread(cluster.stop)
    settings = {
        "request_timeout_s": REQUEST_TIMEOUT_S,
        "drain_s": DRAIN_S,
        "gateway": (
            "the run's strategy with the scenario's strategy_options for it, [affinity] on"
            " +affinity runs and [index_share] on +shared ones, admin_local_only, class_header"
            f" {CLASS_HEADER!r} (the load generator names each request's class), [health]"
            f" interval {HEALTH_INTERVAL}; every other key at its default (`gateway_config`)"
        ),
        "sidecar_sample_interval": SAMPLE_INTERVAL,
        "sidecar_rss_window": RSS_WINDOW,
        "lost_at_crash": (
            "failed requests answered by the crashed node or by none, ending within "
            f"{CRASH_WINDOW_S:g}s after the crash; failures by waiting (timeouts, requests"
            " unfinished at the end, 504s and 408s) left out"
        ),
        "node_states": f"the gateway's /_promptlb/status, read every {STATE_POLL_S:g}s",
        "nginx": "worker_processes 1, max_fails=3 fail_timeout=10s, keepalive 128",
        "litellm": f"Router defaults, timeout {_peers.LITELLM_TIMEOUT_S:g}s",
        "latency": "percentiles over successful requests; error_rate counts the rest",
        "utilisation": "busy slot-seconds / (slots x duration), from the requests' timing",
        "note": "load generator, routers and every node share this machine's cores",
    }
    report = build_report(
        scenario,
        len(trace),
        runs,
        hits,
        slots=cluster.slots,
        settings=settings,
        missing=chosen.missing,
        failed=failed,
        meta=meta,
    )
    plots = {name: run.results for name, run in runs.items()}
    return report, plots


def _run(main: Callable[[], Any]) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with the emulator extra
        return asyncio.run(main())
    return uvloop.run(main())


def run_cluster(args: argparse.Namespace) -> None:
    scenario = load_scenario(args.scenario)
    meta: dict[str, Any] = {}
    if args.duration is not None:
        duration = parse_duration("duration", args.duration)
        if duration <= 0:
            raise ConfigError("duration", args.duration, "> 0")
        if duration != scenario.duration:  # its own length is the scenario as written
            original = scenario.duration
            scenario, scale = scaled(scenario, duration)
            meta = {"scenario_duration_s": original, "fault_time_scale": round(scale, 4)}
    chosen = plan(args.strategies, args.peers)
    replicas = getattr(args, "replicas", 8)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError("replicas", replicas, "an integer >= 1")
    chosen.replicas = replicas
    if scenario.workload.prompts is not None:
        chosen.ours = _livecache.cache_strategies(chosen.ours)
        if ("oracle", "oracle") not in chosen.peers:  # the reference the default is held to
            chosen.peers.append(("oracle", "oracle"))
    out = Path(args.out) if args.out else RESULTS
    try:
        report, plots = _run(lambda: run_all(scenario, chosen, meta))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\ninterrupted: every process started was stopped.", file=sys.stderr)
        raise SystemExit(130) from None
    if not report["runs"]:  # nothing measured: a report of failures replaces no results
        for name, why in report["failed"].items():
            print(f"  {name}: {why[:300]}", file=sys.stderr)
        raise SystemExit(
            f"promptlb-bench cluster {scenario.name}: no run succeeded, nothing written"
        )
    publish(report, plots, scenario, out, plot=not args.no_plot)
