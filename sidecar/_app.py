"""The sidecar service: ``create_app()`` serves the CLI and the tests alike."""
# Over 350 lines: the app factory, its handlers and the collectors that feed them share the Live
# state and the one ClientSession; split, each half would reach into the other.

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import psutil
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from promptlb.shared import EngineSample, GpuSample, SnapshotError

from ._config import SidecarConfig
from ._engine import (
    END_COUNTER_WINDOW_S,
    ENGINES,
    EngineMetricsError,
    EngineReading,
    TokenRate,
    parse_engine_metrics,
)
from ._gpu import GpuCollector, in_daemon_thread
from ._host import HostCollector
from ._live import Live, Problem
from ._model_server import WarmupReport, probe, warmup
from ._names import ModelNames
from ._process import ProcessCollector, is_local_host, is_loopback, memory_free

__all__ = ["LIVE", "create_app"]

log = logging.getLogger("promptlb.sidecar")
STALE_HINT_S = 2.5  # sample intervals above this are warned of: half the gateways' stale_after
GPU_SAMPLE_S = 2.0  # an NVML sample taking longer is hung: the GPUs are left out meanwhile

LIVE = web.AppKey("promptlb_sidecar_live", Live)
_SESSION = web.AppKey("promptlb_sidecar_session", aiohttp.ClientSession)
_REGISTRY = web.AppKey("promptlb_sidecar_registry", CollectorRegistry)
_COUNTS = web.AppKey("promptlb_sidecar_counts", dict[str, Counter])
_MiB = 1024 * 1024
_WARMUP_LOCK = web.AppKey("promptlb_sidecar_warmup_lock", asyncio.Lock)
_WARMUP_PROBLEM = web.AppKey("promptlb_sidecar_warmup_problem", Problem)
# The wait between failed warmups grows to this. Unrequired, the node serves cold meanwhile:
# its warmup is a courtesy that need not ask every 10 s, forever, of a server that refuses it.
_WARMUP_BACKOFF_S = {True: 10.0, False: 300.0}  # by warmup_required


class _LiveMetrics(Collector):
    """Gauges read from the live view at scrape time: one source of truth, nothing to keep in
    step."""

    def __init__(self, live: Live) -> None:
        self._live = live
        self._memory_total = float(psutil.virtual_memory().total)

    def collect(self) -> Iterator[Metric]:
        live = self._live

        def gauge(name: str, doc: str, value: float | None) -> Iterator[GaugeMetricFamily]:
            if value is not None:
                yield GaugeMetricFamily(f"promptlb_sidecar_{name}", doc, value=value)

        yield from gauge("ready", "1 when the model server answers and is warm.", float(live.ready))
        yield from gauge("draining", "1 while draining.", float(live.draining))
        host = live.host
        yield from gauge("cpu_utilization_ratio", "Host CPU use, 0..1.", host and host[0])
        yield from gauge("memory_utilization_ratio", "Host memory use, 0..1.", host and host[1])
        yield from gauge("memory_total_bytes", "Host memory.", self._memory_total)
        if live.engine is not None:
            engine = live.engine
            yield from gauge("engine_running_requests", "Requests the engine runs.", engine.running)
            yield from gauge(
                "engine_waiting_requests", "Requests the engine queues.", engine.waiting
            )
            yield from gauge(
                "engine_kv_cache_usage_ratio", "Engine KV-cache use, 0..1.", engine.kv_cache
            )
            yield from gauge(
                "engine_generation_tokens_per_second", "Tokens the engine generates.", engine.tps
            )
        yield from gauge("model_rss_bytes", "Model-server resident memory.", live.rss)
        yield from gauge(
            "model_rss_slope_bytes_per_second", "Trend of that memory.", live.rss_slope
        )
        # What the gateways' drain projects against: under --memory-limit-mb or the cgroup's
        # limit where there is one, not the host's (an alert on the host's total sat above the
        # real OOM line, silent while the gateway drained the node).
        yield from gauge(
            "model_memory_free_bytes",
            "Memory the model server may still take before it is killed for it.",
            live.mem_free,
        )
        if live.gpus:
            util = GaugeMetricFamily(
                "promptlb_sidecar_gpu_utilization_ratio", "GPU use, 0..1.", labels=["gpu"]
            )
            used = GaugeMetricFamily(
                "promptlb_sidecar_gpu_memory_used_bytes", "GPU memory in use.", labels=["gpu"]
            )
            total = GaugeMetricFamily(
                "promptlb_sidecar_gpu_memory_total_bytes", "GPU memory.", labels=["gpu"]
            )
            for g in live.gpus:
                i = str(g.i)
                if g.util is not None:  # (a card in MIG mode has none)
                    util.add_metric([i], g.util)
                if g.mem_total:  # (a unified-memory board has no reading: 0 of 0)
                    used.add_metric([i], g.mem_used * _MiB)
                    total.add_metric([i], g.mem_total * _MiB)
            yield util
            yield used
            yield total


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _auth_middleware(config: SidecarConfig) -> Callable[..., Awaitable[web.StreamResponse]]:
    token = config.token.encode() if config.token else None

    @web.middleware
    async def auth(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        control = request.method == "POST"
        if not (control or config.protect_reads):
            return await handler(request)
        if control and config.local_control and not is_loopback(request.remote):
            return _json_error(403, "control endpoints answer this host only (--local-control)")
        if token is None:
            return _json_error(
                403,
                "control endpoints are disabled: no token configured "
                "(--token-file or PROMPTLB_SIDECAR_TOKEN)",
            )
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # surrogateescape: aiohttp reads header bytes so; a non-UTF-8 token was a 500 and a
        # traceback per request, anyone's to send.
        given_bytes = given.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given_bytes, token):
            return web.json_response(
                {"error": "a valid bearer token is required"},
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return auth


async def _every(interval: float, step: Callable[[], Awaitable[None]], name: str) -> None:
    """Run ``step`` every ``interval`` (deadline-based, so slow steps do not drift the rest)."""
    loop = asyncio.get_running_loop()
    # A random phase keeps the collectors (and many sidecars on one host) from firing together.
    next_at = loop.time() + random.uniform(0, interval)
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:  # a collector bug must not stop the others or the service
            log.exception("collector %s failed", name)
        next_at = max(next_at + interval, loop.time())
        await asyncio.sleep(next_at - loop.time())


_NAMES = web.AppKey("promptlb_sidecar_model_names", ModelNames)


class _Collectors:
    """The background sampling, one task per collector."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.live = app[LIVE]
        self.config = self.live.config
        self.host = HostCollector()
        self.gpu = GpuCollector(enabled=self.config.gpu, devices=self.config.gpu_devices)
        self.process = ProcessCollector(
            pid=self.config.model_pid,
            port=self.config.model_port if is_local_host(self.config.model_host) else None,
            window_s=self.config.rss_window_s,
            # Against a limit, shared pages count once: the RSS sum counts them per process.
            proportional=self.config.memory_limit is not None,
        )
        self.engine_problem = Problem(log, "engine metrics")
        self.process_problem = Problem(log, "model-server process")
        self.server_problem = Problem(log, "model server")
        self.gpu_problem = Problem(log, "GPU sampling")
        self._gpu_pending: asyncio.Future[tuple[GpuSample, ...]] | None = None
        self._tokens = TokenRate()
        self._failed_probes = 0  # in a row
        self._failed_scrapes = 0  # of /metrics, in a row

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.app[_SESSION]

    async def sample_host(self) -> None:
        live = self.live
        live.host = await asyncio.to_thread(self.host.sample)
        live.gpus = await self._sample_gpus()
        live.changed()

    async def _sample_gpus(self) -> tuple[GpuSample, ...]:
        """The GPUs, off the loop, within `GPU_SAMPLE_S`: NVML calls take milliseconds, but a
        GPU that fell off the bus can block one for good. Sampled with the host in one call,
        such a hang froze the CPU and memory readings too, served as fresh; now the GPUs are
        left out (unknown) until the call returns, and no second one is started meanwhile."""
        pending = self._gpu_pending
        if pending is not None and not pending.done():
            return ()  # still hung: reported when it began
        pending = self._gpu_pending = in_daemon_thread(self.gpu.sample)
        # asyncio.wait, not wait_for: on 3.11 wait_for swallows a cancel that comes as the
        # sample ends, and the collector then outlived the app's shutdown.
        await asyncio.wait((pending,), timeout=GPU_SAMPLE_S)
        if not pending.done():
            self.gpu_problem.report(f"NVML has not answered in {GPU_SAMPLE_S:g}s: GPUs left out")
            return ()
        self.gpu_problem.clear()
        return pending.result()

    def _process_and_memory(self, serving: bool) -> tuple[int | None, float | None, int | None]:
        rss, slope = self.process.sample()
        if not serving:
            # Loading the weights and warming up grow the RSS by gigabytes: were those samples
            # kept, the first slope of a ready node would be a "leak". The window starts when
            # the node serves.
            self.process.restart_window()
            slope = None
        held = self.process.pss if self.process.pss is not None else rss
        return rss, slope, memory_free(held, self.config.memory_limit, self.process.pid)

    async def sample_process(self) -> None:
        # psutil's port lookup walks /proc: keep it off the event loop.
        live = self.live
        # Read before the sample: a node that becomes ready meanwhile gets no slope from it.
        serving = live.ready
        live.rss, live.rss_slope, live.mem_free = await asyncio.to_thread(
            self._process_and_memory, serving
        )
        if self.process.reason:
            self.process_problem.report(self.process.reason)
        else:
            self.process_problem.clear()
        if self.process.restarted:
            self.app[_NAMES].expire()  # the new process may serve another model
            if live.server_ok and self.process.pid is None:
                # Seen gone before the probe saw it: said so, until the probe says otherwise.
                live.server_ok = False
                live.server_reason = "model-server process exited"
            if live.warm:
                # A restart quicker than one probe never looks "gone" to the probe, but the new
                # process has lost its caches all the same.
                live.warm = False
                log.warning("model-server process exited: warmup will run again")
        live.changed()

    async def sample_engine(self) -> None:
        cfg = self.config
        engine: EngineSample | None = None
        try:
            async with self.session.get(
                cfg.model_url + "/metrics",
                timeout=aiohttp.ClientTimeout(total=cfg.probe_timeout_s),
            ) as response:
                text = await response.text(errors="replace")
                if response.status != 200:
                    raise EngineMetricsError(f"/metrics answered {response.status}")
            reading = parse_engine_metrics(text, cfg.engine)  # type: ignore[arg-type]
            tps = self._tokens_per_s(reading)
            engine = EngineSample(
                running=reading.running,
                waiting=reading.waiting,
                kv_cache=reading.kv_cache,
                tps=tps,
                kv_tokens=reading.kv_tokens,
            )
            self.engine_problem.clear()
        except (EngineMetricsError, SnapshotError) as exc:  # unreadable, or out of range
            self.engine_problem.report(str(exc))
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.engine_problem.report(f"/metrics unreachable: {type(exc).__name__}: {exc}")
        if engine is None:
            self._failed_scrapes += 1
            if self._failed_scrapes < cfg.unhealthy_after:
                # The last reading stands through fewer failures in a row than the probe
                # tolerates: a loaded engine answers /metrics late exactly when it is busiest,
                # and a snapshot without its queue made the busiest node look idle.
                return
            self._tokens.reset()
        else:
            self._failed_scrapes = 0
            self.live.engine_read_at = time.monotonic()
        self.live.engine = engine
        self.live.changed()

    def _tokens_per_s(self, reading: EngineReading) -> float | None:
        window = END_COUNTER_WINDOW_S if ENGINES[reading.engine].tokens_at_end else 0.0
        if self._tokens.window_s != window:  # another engine behind the URL
            self._tokens = TokenRate(window)
        counted = self._tokens.update(asyncio.get_running_loop().time(), reading.tokens_total)
        return reading.tps if reading.tps is not None else counted

    async def probe_server(self) -> None:
        live, cfg = self.live, self.config
        result = await probe(self.session, cfg.model_url, cfg.probe_timeout_s)
        was_ok = live.server_ok
        self._failed_probes = 0 if result.ok else self._failed_probes + 1
        if result.ok:
            self.server_problem.clear()
            names = self.app[_NAMES]
            # Each time the server comes up (it may be a new one, with another model), and
            # whenever the names are due: a failed answer must not leave them unknown for good.
            # Before the server reads as up: a ready snapshot naming no model yet makes the
            # node one that takes any model at the gateways, for a moment.
            if not cfg.models and (not was_ok or names.due()):
                await names.learn(self.session)
        # A server that was ready stays so through fewer failures than `unhealthy_after` in a
        # row, unless it is gone (refused: restarting or dead, nothing to wait for).
        if result.ok or result.gone or not was_ok or self._failed_probes >= cfg.unhealthy_after:
            live.server_ok = result.ok
            live.server_reason = result.reason
        if not result.ok:
            self.server_problem.report(result.reason)
            if result.gone and live.warm:
                live.warm = False  # a restarted server is cold again
                log.warning("model server went away: warmup will run again")
        live.changed()

    async def warm_when_ready(self) -> None:
        """Warm up whenever the server answers and is not warm; back off after failures."""
        backoff = 0.5
        while True:
            live = self.live
            if live.warm or not live.server_ok:
                # Warmed (by a POST /warmup too) or gone: a node cold again later starts
                # over, not at a cap its earlier failures reached (5 minutes unrequired).
                backoff = 0.5
            else:
                try:
                    ok = (await run_warmup(self.app)).ok
                except Exception:  # a bug must not end warming for good, a restart cold
                    log.exception("warmup failed")
                    ok = False
                if not ok:
                    await self._wait_cold(backoff)
                    cap = _WARMUP_BACKOFF_S[self.config.warmup_required]
                    backoff = min(backoff * 2, cap)
                    continue
            await asyncio.sleep(self.config.sample_interval_s)

    async def _wait_cold(self, seconds: float) -> None:
        """Up to ``seconds``, in sample intervals, while the node stays cold and its server
        up: a server that restarts meanwhile (or a POST /warmup) ends the wait, which could
        otherwise hold a restarted node's warmup for minutes."""
        live, step = self.live, self.config.sample_interval_s
        deadline = asyncio.get_running_loop().time() + seconds
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            await asyncio.sleep(min(step, left))
            if live.warm or not live.server_ok:
                return

    def tasks(self) -> list[asyncio.Task[None]]:
        interval = self.config.sample_interval_s
        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("host", self.sample_host),
            ("process", self.sample_process),
            ("probe", self.probe_server),
        ]
        if self.config.engine != "none":
            steps.append(("engine", self.sample_engine))
        tasks = [
            asyncio.create_task(_every(interval, step, name), name=f"sidecar-{name}")
            for name, step in steps
        ]
        if self.config.warmup_at_start:
            tasks.append(asyncio.create_task(self.warm_when_ready(), name="sidecar-warmup"))
        return tasks


async def run_warmup(app: web.Application) -> WarmupReport:
    live, cfg = app[LIVE], app[LIVE].config
    async with app[_WARMUP_LOCK]:
        model = (cfg.models or live.models or ("",))[0]
        if not model:
            # Names found here are kept too: the probe's own request may have failed.
            models = await app[_NAMES].learn(app[_SESSION])
            model = models[0] if models else "default"
        report = await warmup(
            app[_SESSION],
            cfg.model_url,
            model=model,
            prompts=cfg.warmup_prompts,
            max_tokens=cfg.warmup_max_tokens,
            timeout=cfg.warmup_timeout_s,
            endpoint=cfg.warmup_endpoint,
        )
        app[_COUNTS]["warmups"].labels("ok" if report.ok else "failed").inc()
        live.warmup = report
        if report.ok:
            app[_WARMUP_PROBLEM].clear()
            if not live.warm:
                log.info("warm: %s", report.as_json()["durations_ms"])
            live.warm = True
        else:
            # Once per change: retried with backoff, the same refusal was a warning each time.
            app[_WARMUP_PROBLEM].report(f"failed: {report.error}")
        live.changed()
        return report


async def _background(app: web.Application) -> AsyncIterator[None]:
    collectors = _Collectors(app)
    config = collectors.config
    if config.sample_interval_s > STALE_HINT_S:
        # A snapshot is as old as its last sample: past the gateways' default stale_after (5 s)
        # between two, they drop it and read the node's load as unknown, now and then.
        log.warning(
            "--sample-interval %gs: the gateways' stale_after must exceed it (5 s by default)",
            config.sample_interval_s,
        )
    # One session for every call to the model server; a small pool, as there are only a few.
    key = config.model_api_key
    app[_SESSION] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=8),
        timeout=aiohttp.ClientTimeout(total=config.warmup_timeout_s),
        # The session calls the model server alone: its key goes on every call.
        headers={"Authorization": f"Bearer {key}"} if key else None,
    )
    # NVML starts in the first GPU sample, within its time limit: started here, a GPU off the
    # bus kept the sidecar from ever listening.
    tasks = collectors.tasks()
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await app[_SESSION].close()
        # After any sample still running in its thread (cancelling the task does not stop it).
        await asyncio.to_thread(collectors.gpu.close)


async def _health(request: web.Request) -> web.Response:
    live = request.app[LIVE]
    reasons = live.reasons()
    body = {
        "status": "ok" if not reasons else "unavailable",
        "node": live.config.node_name,
        "ready": live.ready,
        "warm": live.warm_enough,
        "draining": live.draining,
        "reasons": reasons,
        "warmup": live.warmup.as_json() if live.warmup else None,
    }
    return web.json_response(body, status=200 if not reasons else 503)


async def _snapshot(request: web.Request) -> web.Response:
    request.app[_COUNTS]["snapshots"].inc()
    return web.Response(body=request.app[LIVE].encoded(), content_type="application/msgpack")


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=generate_latest(request.app[_REGISTRY]),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def _warmup(request: web.Request) -> web.Response:
    report = await run_warmup(request.app)
    return web.json_response(report.as_json(), status=200 if report.ok else 502)


def _set_draining(value: bool) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        live = request.app[LIVE]
        if live.draining != value:
            log.info("draining" if value else "no longer draining")
        live.draining = value
        live.changed()
        return web.json_response({"node": live.config.node_name, "draining": live.draining})

    return handler


def create_app(config: SidecarConfig) -> web.Application:
    """The sidecar as an aiohttp app; its collectors run while the app runs."""
    app = web.Application(middlewares=[_auth_middleware(config)], client_max_size=64 * 1024)
    live = Live(config)
    app[LIVE] = live
    app[_WARMUP_LOCK] = asyncio.Lock()
    app[_WARMUP_PROBLEM] = Problem(log, "warmup")
    app[_NAMES] = ModelNames(live)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_LiveMetrics(live))
    app[_REGISTRY] = registry
    app[_COUNTS] = {
        "snapshots": Counter(
            "promptlb_sidecar_snapshot_requests", "Snapshots served.", registry=registry
        ),
        "warmups": Counter(
            "promptlb_sidecar_warmups", "Warmup runs.", ["result"], registry=registry
        ),
    }
    app.cleanup_ctx.append(_background)
    app.router.add_get("/health", _health)
    app.router.add_get("/snapshot", _snapshot)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/warmup", _warmup)
    app.router.add_post("/drain", _set_draining(True))
    app.router.add_post("/undrain", _set_draining(False))
    return app
