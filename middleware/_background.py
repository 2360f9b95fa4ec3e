"""The evidence loops: gossip with sidecars, active health checks, DNS discovery.

Each runs as one task per middleware (never per request), with bounded concurrency and timeouts.
A sidecar that is unreachable or sends garbage leaves the node's last good view in place until
it goes stale; the event is counted, and nothing here ever raises into the request path.
"""

# Over 350 lines: the three loops share one gate, one failure log and one round structure
# (per-node tasks, sit-outs, a reload's carried counts); split, each half would reach into the
# other's state.

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
import re
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
from promptlb.shared import (
    MAX_SNAPSHOT_BYTES,
    FreshnessCheck,
    SigningKey,
    SnapshotError,
    decode,
)

from ._config import GOSSIP_JITTER, Config, NodeConfig
from ._metrics import Metrics
from ._nodes import Node, NodeTable

__all__ = ["Evidence"]

log = logging.getLogger("promptlb.middleware")

_NUMBERS = re.compile(r"\d+(?:\.\d+)?")
_HEALTH_BYTES = 64 * 1024  # more than any health answer: the rest is not read


async def _capped(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body, or None when it passes ``limit`` bytes (the connection is then closed, not
    read on). A sidecar that streamed hundreds of MB was read whole before the decoder's own
    bound refused it: 32 at once, every round, on the loop that serves requests."""
    length = response.content_length
    if length is not None and length > limit:
        response.close()
        return None
    data = bytearray()
    async for chunk in response.content.iter_chunked(16 * 1024):
        data += chunk
        if len(data) > limit:
            response.close()
            return None
    return bytes(data)


_MAX_SIT_OUT = 7  # rounds a failing sidecar sits out at most (`Evidence._due`)


class _Gate:
    """The slots of sidecar polls: waiters that answered last time first, then those that
    failed once (a blip), then those that failed twice or more, each in arrival order; the
    last hold at most a quarter of the slots, so that polls of dead sidecars, however many
    and whenever queued, never stand ahead of a healthy one."""

    __slots__ = ("_failing_free", "_free", "_order", "_waiters")

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._failing_free = max(1, slots // 4)
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap
        self._order = itertools.count()

    async def acquire(self, failed: int) -> None:
        future = asyncio.get_running_loop().create_future()
        # Those that failed twice or more in arrival order among themselves: by their count,
        # one long dead that came back waited behind every sidecar that began failing since.
        heapq.heappush(self._waiters, (min(failed, 2), next(self._order), future))
        self._serve()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(failed)  # given a slot, and cancelled before it ran
            raise

    def release(self, failed: int) -> None:
        self._free += 1
        if failed > 1:
            self._failing_free += 1
        self._serve()

    def _serve(self) -> None:
        waiters = self._waiters
        while waiters and self._free > 0:
            failed, _, future = waiters[0]
            if future.done():  # (cancelled while waiting)
                heapq.heappop(waiters)
                continue
            if failed > 1 and self._failing_free <= 0:
                return  # the rest fail too (fewest first): they wait for a failing slot
            heapq.heappop(waiters)
            self._free -= 1
            if failed > 1:
                self._failing_free -= 1
            future.set_result(None)


def _log_failure(task: asyncio.Task[None]) -> None:
    """A poll or check that raised what it does not handle (a bug): logged, as the round that
    awaited it logged it, not left to asyncio's "exception was never retrieved"."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("%s failed", task.get_name(), exc_info=exc)


class Evidence:
    """Keeps a `NodeTable` honest: snapshots, health, membership, and the passage of time."""

    def __init__(
        self,
        config: Config,
        table: NodeTable,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        previous: Evidence | None = None,
    ) -> None:
        self._config = config
        self._table = table
        self._session = session
        self._metrics = metrics
        keys = config.sign_keys()
        self._keys: dict[str, SigningKey] | None = {k.kid: k for k in keys} if keys else None
        window = max(config.stale_after, 1.0)
        self._freshness: FreshnessCheck | None = None
        if keys:
            # Carried over a reload: a fresh one passed a replay still in its window (one
            # older than the snapshot in force), which was then neither counted nor logged.
            held = previous._freshness if previous is not None else None
            self._freshness = held if held is not None else FreshnessCheck(window)
            self._freshness.window_s = window
        token = config.sidecar_token()
        self._sidecar_headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._gate = _Gate(config.gossip_concurrency)
        # Health probes have a gate of their own: an unreachable node holds a slot for up to
        # two probe timeouts (its sidecar's, then the server's), and in a partition of a
        # hundred nodes the snapshots of the healthy ones queued behind them and went stale.
        self._health_gate = asyncio.Semaphore(config.gossip_concurrency)
        # Sidecars whose polls failed, by failures in a row, and the rounds each still sits
        # out (both carried over a reload, `carry_counts`): hundreds unreachable at once held
        # every slot for a timeout each, and the healthy nodes' snapshots queued behind them
        # and went stale. The gate serves the fewest failures first, whenever they came (in
        # arrival order, dead polls of earlier rounds stood ahead of every later healthy
        # one), and lets those failing hold at most a quarter of the slots; one failing twice
        # or more is also asked less often (`_due`). One failure (a blip) costs nothing.
        self._failures: dict[str, int] = {}
        self._sit_out: dict[str, int] = {}
        # Each node's poll and check under way: a round starts one only where none is, and
        # waits for its own at most a timeout (`_round`).
        self._polls: dict[str, asyncio.Task[None]] = {}
        self._checks: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._problems: dict[tuple[str, str], str] = {}

    async def start(self, *, first: bool = True) -> None:
        """One round of everything first, so that the first request finds a real view: the
        whole of it for the gateway's ``first`` start (a reload's newcomers were checked
        before they joined, and DNS discovery checks what it finds), at most a timeout's
        worth otherwise, so that no gossip or health loop stands still behind hung nodes."""
        dns = self._config.discovery.mode == "dns"
        if dns:
            await self.discover()
        whole = first and not dns
        await asyncio.gather(self.gossip_round(whole=whole), self.health_round(whole=whole))
        self._table.settled = True
        self._table.tick(time.monotonic())
        cfg = self._config
        gossip_jitter = cfg.gossip_interval * GOSSIP_JITTER
        loops: list[tuple[str, Callable[[], float], Callable[[], Awaitable[None]]]] = [
            ("gossip", _jittered(cfg.gossip_interval, gossip_jitter), self.gossip_round),
        ]
        if cfg.health.enabled:
            health = cfg.health
            pause = _jittered(health.interval, health.interval_jitter)
            loops.append(("health", pause, self.health_round))
        if cfg.discovery.mode == "dns":
            loops.append(("dns", self._discovery_pause(), self.discover))
        self._tasks = [
            asyncio.create_task(self._every(*loop), name=f"promptlb-{loop[0]}") for loop in loops
        ]

    async def check(self, nodes: list[Node]) -> None:
        """One health check and one gossip of each of ``nodes`` (joining, or about to)."""
        checks = nodes if self._config.health.enabled else []
        await asyncio.gather(
            *(self._check(n) for n in checks),
            *(self._gossip(n) for n in nodes if n.config.sidecar),
        )

    def carry_counts(self, previous: Evidence, changed: tuple[list[str], list[str]]) -> None:
        """A reload: the failures in a row and sit-outs of ``previous`` (read once its loops
        stopped: copied sooner, a node that answered meanwhile kept its old count), but those
        of the nodes ``changed`` (`NodeTable.reconfigure`'s): added or now another server,
        whose check before joining counted here already, and removed (kept, they piled up
        under discovery's coming and going names)."""
        skip = {*changed[0], *changed[1]}
        failures = {k: v for k, v in previous._failures.items() if k not in skip}
        sit_out = {k: v for k, v in previous._sit_out.items() if k not in skip}
        self._failures = failures | self._failures
        self._sit_out = sit_out | self._sit_out

    def forget(self, name: str) -> None:
        """Node ``name`` left the table: under discovery, names come and go for good."""
        if self._freshness is not None:
            self._freshness.forget(name)
        self._failures.pop(name, None)
        self._sit_out.pop(name, None)
        for under_way in (self._polls, self._checks):
            task = under_way.pop(name, None)
            if task is not None:
                task.cancel()

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._polls.values(), *self._checks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        self._polls.clear()
        self._checks.clear()

    async def _round(
        self,
        under_way: dict[str, asyncio.Task[None]],
        nodes: list[Node],
        step: Callable[[Node], Coroutine[Any, Any, None]],
        wait: float | None,
    ) -> None:
        """``step`` for each of ``nodes`` with none under way, in their order, waited for at
        most ``wait`` seconds (None: all of them, as startup does): one still going (a hung
        sidecar, a node behind a full gate) goes on past the round and holds back only its
        own node, where a round that waited for every one ran as long as its slowest wave
        (hundreds of unreachable sidecars: a few seconds a round, every snapshot stale)."""
        started = []
        for node in nodes:
            task = under_way.get(node.name)
            if task is None or task.done():
                name = f"promptlb-{step.__name__.lstrip('_')}-{node.name}"
                under_way[node.name] = task = asyncio.create_task(step(node), name=name)
                task.add_done_callback(_log_failure)
                started.append(task)
        if started:
            await asyncio.wait(started, timeout=wait)

    async def _every(
        self, name: str, pause: Callable[[], float], step: Callable[[], Awaitable[None]]
    ) -> None:
        while True:
            await asyncio.sleep(pause())
            try:
                await step()
            except Exception:  # a bug in one loop must not take the others, or requests, down
                log.exception("promptlb %s loop failed", name)
            self._table.tick(time.monotonic())

    def _discovery_pause(self) -> Callable[[], float]:
        """The pauses between lookups: `discovery.interval`; while none has found a node,
        sooner (1 s, doubling up to the interval): a gateway that started before its Service
        had ready endpoints, or on a DNS hiccup, refused every request for a whole interval."""
        interval = self._config.discovery.interval
        last: float | None = None  # the last pause while no node is found

        def pause() -> float:
            nonlocal last
            if self._table.nodes:
                last = None
                return interval
            last = min(interval, 1.0 if last is None else 2 * last)
            return last

        return pause

    def _problem(self, node: Node, kind: str, message: str | None) -> None:
        """Log a node's problem once when it starts or changes, and once when it clears."""
        key = (node.name, kind)
        if message is None:
            if self._problems.pop(key, None) is not None:
                log.info("node %s: %s ok again", node.name, kind)
            return
        # The same problem with other numbers is no change: a sidecar's clock off by more
        # than stale_after logged "is 6.1s old", "is 6.2s old"... every round.
        same = _NUMBERS.sub("#", message)
        if self._problems.get(key) != same:
            self._problems[key] = same
            log.warning("node %s: %s: %s", node.name, kind, message)

    def _dropped(self, node: Node) -> bool:
        """Whether ``node``, listed when a round began, has left the table since (a pod
        discovery dropped): what the round finds of it is kept nowhere."""
        return self._table.nodes.get(node.name) is not node

    # -- gossip ----------------------------------------------------------------------------
    async def gossip_round(self, *, whole: bool = False) -> None:
        # (In table order: the gate serves them by their failures in a row itself.)
        nodes = [n for n in self._table.nodes.values() if n.config.sidecar and self._due(n)]
        wait = None if whole else self._config.gossip_timeout
        await self._round(self._polls, nodes, self._gossip, wait)

    def _due(self, node: Node) -> bool:
        """Whether a round asks ``node``'s sidecar: one failing sits out rounds, 1, 3, 7 after
        its second, third, fourth failure in a row (at most 7): a blip costs no round, and a
        dead sidecar takes a slot an eighth as often, while still found back within seconds."""
        left = self._sit_out.get(node.name)
        if not left:
            return True
        self._sit_out[node.name] = left - 1
        return False

    async def _gossip(self, node: Node) -> None:
        timeout = aiohttp.ClientTimeout(total=self._config.gossip_timeout)
        # A newcomer is polled before it joins (`check`): only a listed node can be dropped.
        listed = not self._dropped(node)
        failures = self._failures
        failed = failures.get(node.name, 0)
        await self._gate.acquire(failed)
        try:
            async with self._session.get(
                f"{node.config.sidecar}/snapshot",
                timeout=timeout,
                headers=self._sidecar_headers,
            ) as response:
                if response.status != 200:
                    raise SnapshotError(f"sidecar /snapshot answered {response.status}")
                body = await _capped(response, MAX_SNAPSHOT_BYTES)
                if body is None:
                    raise SnapshotError(
                        f"sidecar /snapshot answered more than {MAX_SNAPSHOT_BYTES} bytes"
                    )
            if listed and self._dropped(node):
                return  # dropped during the round (a pod gone): nothing to keep of it
            snapshot = decode(body, self._keys)
            held = node.snapshot
            if held is not None and (held.boot, held.seq) == (snapshot.boot, snapshot.seq):
                failures.pop(node.name, None)
                # (Answering again ends a problem: left open, its "ok again" never came, and
                # the same failure later was not told either.)
                self._problem(node, "snapshot", None)
                return  # the sidecar saw nothing new since the last poll: no news, no error
            if snapshot.node != node.name and self._keys is not None:
                raise SnapshotError(
                    f"signed snapshot names node {snapshot.node!r}, not {node.name!r}"
                    " (the sidecar's --node-name must be the node's name here)"
                )
            if self._freshness is not None:
                # (One with a snapshot already returned above on the same boot and seq.)
                self._freshness.check(snapshot, again=held is None)
        except (aiohttp.ClientError, TimeoutError, SnapshotError) as exc:
            in_a_row = failures[node.name] = failed + 1
            if in_a_row > 1:
                self._sit_out[node.name] = min(2 ** (in_a_row - 1) - 1, _MAX_SIT_OUT)
            node.snapshot_errors += 1
            if listed and self._dropped(node):
                return  # gone during the round: its problems went with it
            kind = "rejected" if isinstance(exc, SnapshotError) else "unreachable"
            if listed:  # a newcomer's series would be made for a node that may not join
                self._metrics.snapshot_errors.labels(node.name, kind).inc()
            self._problem(node, "snapshot", f"{type(exc).__name__}: {exc}")
            return
        finally:
            self._gate.release(failed)
        failures.pop(node.name, None)
        self._problem(node, "snapshot", None)
        self._table.record_snapshot(node, snapshot, time.monotonic())

    # -- active health checks --------------------------------------------------------------
    async def health_round(self, *, whole: bool = False) -> None:
        health = self._config.health
        if health.enabled:
            nodes = list(self._table.nodes.values())
            wait = None if whole else 2 * health.timeout
            await self._round(self._checks, nodes, self._check, wait)

    async def _check(self, node: Node) -> None:
        health = self._config.health
        sidecar = node.config.sidecar if health.use_sidecar else None
        verdict = None
        listed = not self._dropped(node)  # (a newcomer is checked unlisted)
        if sidecar:
            verdict = await self._probe(f"{sidecar}/health", self._sidecar_headers, sidecar=True)
            if listed and self._dropped(node):
                return  # dropped during the check: its problems went with it
            # The sidecar is evidence, not the gatekeeper: when it cannot say (down, or answering
            # what its /health never answers), the model server is asked directly, and the node
            # serves on that and on what the balancer sees of its answers.
            self._problem(
                node,
                "sidecar",
                None if verdict is not None else "cannot say; checking the model server directly",
            )
        if verdict is None:
            verdict = await self._probe(f"{node.config.url}{health.path}", {}, sidecar=False)
            if listed and self._dropped(node):
                return
        assert verdict is not None
        ok, detail = verdict
        was = node.health_ok
        self._table.record_health(node, ok, detail, time.monotonic())
        if node.health_ok != was:
            log.log(
                logging.INFO if node.health_ok else logging.WARNING,
                "node %s is %s (%s)",
                node.name,
                "healthy" if node.health_ok else "unhealthy",
                detail,
            )

    async def _probe(
        self, url: str, headers: dict[str, str], *, sidecar: bool
    ) -> tuple[bool, str] | None:
        """``(healthy, detail)`` from one health endpoint. A sidecar's answer is a verdict
        only when it is one of its own (a pass, or 503 with reasons): None otherwise, and when
        it cannot be reached."""
        health = self._config.health
        try:
            async with (
                self._health_gate,
                self._session.get(
                    url, timeout=aiohttp.ClientTimeout(total=health.timeout), headers=headers
                ) as response,
            ):
                # Read (so that the connection is reused), but not past a health answer's size:
                # a broken or hostile endpoint streamed into memory every round.
                await _capped(response, _HEALTH_BYTES)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if sidecar:
                return None
            return False, f"{url}: {type(exc).__name__}: {exc}"
        ok = health.expected(response.status)
        if sidecar and not ok and response.status != 503:
            return None
        return ok, f"{url} answered {response.status}"

    # -- DNS discovery ---------------------------------------------------------------------
    async def discover(self) -> None:
        disc = self._config.discovery
        try:
            async with asyncio.timeout(disc.timeout):
                infos = await asyncio.get_running_loop().getaddrinfo(
                    disc.name, disc.port, type=socket.SOCK_STREAM
                )
        except (OSError, TimeoutError, UnicodeError) as exc:  # (a name the codec refuses)
            reason = exc if not isinstance(exc, TimeoutError) else f"no answer in {disc.timeout:g}s"
            log.warning(
                "dns discovery of %s failed: %s; keeping the current nodes", disc.name, reason
            )
            return
        wanted: list[NodeConfig] = []
        for family, _, _, _, address in infos:
            host = f"[{address[0]}]" if family == socket.AF_INET6 else str(address[0])
            sidecar = None
            if disc.sidecar_port:
                sidecar = f"{disc.sidecar_scheme}://{host}:{disc.sidecar_port}"
            wanted.append(
                NodeConfig(
                    name=f"{host}:{disc.port}",
                    url=f"{disc.scheme}://{host}:{disc.port}",
                    sidecar=sidecar,
                    models=disc.models,
                )
            )
        if not wanted:
            return  # an empty answer is more likely a DNS hiccup than a cluster of none
        before = set(self._table.nodes)
        # Newcomers (and nodes a reload's sidecar port or scheme replaced) are checked before
        # they join, as a static reload's are: joined unchecked they were no candidates until
        # the next health round, and a replaced node took its model's traffic with it.
        incoming = self._table.incoming(wanted)
        if incoming:
            await self.check(incoming)
        self._table.replace_members(wanted, incoming)
        after = set(self._table.nodes)
        if before != after:
            log.info("dns discovery: +%s -%s", sorted(after - before), sorted(before - after))
            # A pod gone takes its logged problems with it: an address a new pod reuses has
            # its own logged afresh, and the entries do not grow with churn. (Not on `forget`:
            # a node replaced under its name had its check's problems just logged.)
            gone = before - after
            for key in [k for k in self._problems if k[0] in gone]:
                del self._problems[key]


def _jittered(interval: float, jitter: float) -> Callable[[], float]:
    """Pauses of ``interval`` plus up to ``jitter``, drawn anew each time."""
    return lambda: interval + random.uniform(0, jitter)
