"""The node table: each node's state, and the per-model candidate lists the hot path reads.

State changes (a health result, a snapshot, an ejection) mark the table dirty; the next
`candidates()` call rebuilds the lists once. The request path therefore costs one dict lookup.
"""
# Over 350 lines: the node state machine and the table of candidates it feeds are read together on
# the hot path.

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from promptlb.shared import Snapshot

from ._config import Config, NodeConfig
from ._rules import after_try, eases, ejection_cap, ejection_time, faded, ramp
from ._view import NodeView

__all__ = ["Node", "NodeTable", "leak_mark"]

_EWMA = 0.2  # weight of the newest latency/TTFT observation
# Recent answers kept per node for the status page's percentiles: appending to a bounded deque
# is all a request pays; sorting 256 floats happens at status time, about once a second.
RECENT = 256

log = logging.getLogger("promptlb.middleware")


@dataclass(slots=True, eq=False)
class Node:
    """A node and everything known about it. Times are ``time.monotonic()``."""

    config: NodeConfig
    view: NodeView
    health_ok: bool | None = None  # None: not checked yet
    health_detail: str = "not checked yet"
    health_streak: int = 0  # consecutive results of the current direction
    snapshot: Snapshot | None = None
    snapshot_at: float = 0.0
    snapshot_errors: int = 0
    consecutive_failures: int = 0
    times_ejected: int = 0
    ejected_until: float = 0.0
    eased_at: float = 0.0  # when `times_ejected` last came down a step
    ready_since: float | None = None
    requests: int = 0
    failures: int = 0
    request_faults: int = 0  # tries that failed through the request's fault: not counted above
    # Answers 4xx but 429: ok for the node's health, but a node that refuses every request (a
    # wrong key, a model it lacks) shows here and nowhere else.
    refusals: int = 0
    # Tokens a second for one running request, as the sidecar last showed it generating (its
    # engine's rate over its running count); None: never shown. A stalled engine (nothing
    # generated) leaves it as it was: a hung node must not look as if it were merely slow.
    decode_rate: float | None = None
    picks: int = 0
    faded_at: float | None = None  # when the error rate last faded; None: not yet
    # (boot, RSS) when a leak projected its model server out of memory: drained until a new
    # boot or less memory than that.
    leak_mark: tuple[str, int] | None = None
    learnt_models: frozenset[str] = field(default_factory=frozenset)
    # Its state (with and without its ejection) when the candidate lists were last built: a
    # result or snapshot rebuilds them only when the state it leaves differs from this.
    listed: tuple[str, str] | None = None
    recent_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    recent_ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    # A plain field, not a property of the config: read several times on every request. A
    # node keeps its name across reloads (the table is keyed by it).
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.config.name

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self.config.models) or self.learnt_models

    def state(
        self, now: float, stale_after: float, oom_within: float = 0.0, *, ejection: bool = True
    ) -> str:
        """``ejection`` False: the state it would be in but for an ejection."""
        snap = self.snapshot if now - self.snapshot_at <= stale_after else None
        if ejection and now < self.ejected_until:
            return "ejected"
        if self.health_ok is None:
            return "unknown"
        if not self.health_ok:
            return "unhealthy"
        # Draining is the sidecar's last word, stale or not: one that stops answering mid-drain
        # (its pod terminating, the sidecar gone first) has not undone it, and the model
        # server still answering health checks made the node "ready" again after stale_after.
        # A new snapshot that is not draining (a sidecar back, a new pod) clears it.
        last = self.snapshot
        if last is not None and last.draining:
            return "draining"
        if snap is not None and not (snap.ready and snap.warm):
            return "warming"
        if last is not None and self.leak_mark is not None and oom_within > 0:
            # As draining: the mark stands until a snapshot clears it (a restart, the memory
            # back), stale or not; a sidecar gone quiet gave the node its full share back
            # after stale_after. (A mark made before a reload turned the projection off drains
            # no more: it would have held the node until its model server restarted.)
            return "leaking"
        return "ready"


class NodeTable:
    """All nodes of one middleware, and the candidate lists per model."""

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.monotonic) -> None:
        # The clock is injectable so that tests and a simulator can run on virtual time.
        self._clock = clock
        self._config = config
        self.nodes: dict[str, Node] = {}
        self._candidates: dict[str, list[NodeView]] = {}
        self._serving: set[str] | None = None  # the names in any candidate list, once asked
        self._known_models: set[str] = set()
        # Told of each node that leaves (the balancer's strategy forgets what it learnt of it).
        self.on_remove: Callable[[str], None] | None = None
        self._wildcard: list[NodeView] = []
        self._any_wildcard = False
        self._dirty = True
        # Until the first round of evidence is in, nodes are the starting cluster, not joiners:
        # slow start would only slow them all alike.
        self.settled = False
        for node_config in config.nodes:
            self.add(node_config)

    # -- membership ------------------------------------------------------------------------
    def add(self, node_config: NodeConfig) -> Node:
        node = self.make(node_config)
        self.nodes[node.name] = node
        self._dirty = True
        return node

    def make(self, node_config: NodeConfig, config: Config | None = None) -> Node:
        """A node for this table, not in it yet (a reload checks newcomers before they join),
        under ``config`` (a reload's, before the table takes it) or the table's own."""
        config = self._config if config is None else config
        view = NodeView(
            name=node_config.name,
            url=node_config.url,
            weight=node_config.weight,
            models=frozenset(node_config.models),
            tags=frozenset(node_config.tags),
        )
        node = Node(node_config, view)
        if not config.health.enabled:
            node.health_ok = True
            now = self._clock()
            # As the health path does: the starting cluster is not slowed, a joiner ramps.
            node.ready_since = now if self.settled else now - config.slow_start
        return node

    def remove(self, name: str) -> None:
        if self.nodes.pop(name, None) is not None:
            self._dirty = True
            if self.on_remove is not None:
                self.on_remove(name)

    def replace_members(self, wanted: Iterable[NodeConfig], ready: Iterable[Node] = ()) -> None:
        """Discovery's answer: add the new nodes, drop the gone ones, keep the rest with what
        is known of them, their config as discovery now builds it (a reload that changed
        `discovery.models`, the sidecar's port or scheme left every current node on the old
        one until its pod went away). ``ready``: the `incoming` nodes, already checked."""
        wanted_by_name = {n.name: n for n in wanted}
        checked = {n.name: n for n in ready}
        for name in list(self.nodes):
            if name not in wanted_by_name:
                self.remove(name)
        for node_config in wanted_by_name.values():
            self._apply(node_config, checked)

    def incoming(self, wanted: Iterable[NodeConfig], config: Config | None = None) -> list[Node]:
        """The nodes `replace_members` (or a reload) would add or replace (a new name, or
        another server under one), built but not joined, so that they can be checked first."""
        return [self.make(n, config) for n in wanted if self._another(n)]

    def _another(self, node_config: NodeConfig) -> bool:
        """Whether ``node_config`` is a server the table does not have: a new name, or a new
        URL or sidecar for a name."""
        current = self.nodes.get(node_config.name)
        return current is None or (current.config.url, current.config.sidecar) != (
            node_config.url,
            node_config.sidecar,
        )

    def newcomers(self, config: Config) -> list[Node]:
        """The nodes a reload to ``config`` brings in (new names, or a new URL or sidecar for
        a name: another server), built but not joined, so that they can be checked first."""
        if config.discovery.mode == "dns":
            return []
        # Under the reload's health setting: built under the old one, a newcomer joined as
        # "unknown" for good when the reload also turned health checks off, or as ready
        # unchecked when it turned them on.
        return self.incoming(config.nodes, config)

    def reconfigure(
        self, config: Config, newcomers: Iterable[Node] = ()
    ) -> tuple[list[str], list[str]]:
        """A reloaded config: its settings from now on, and its ``[[nodes]]`` as the members
        (under DNS discovery the members stay discovery's). A node whose name, URL and sidecar
        are unchanged keeps everything known of it (health, snapshot, ejection, learnt speed);
        its weight, models and tags follow the new config. A changed URL or sidecar is another
        server: the node starts afresh, as the `newcomers` object when given (already checked).
        Requests open on a node that is gone or replaced finish on the `Node` object they hold.
        Returns the names added (or replaced) and removed."""
        ready = {n.name: n for n in newcomers}
        if config.outlier.drain_before_oom != self._config.outlier.drain_before_oom:
            # Marks made under the old projection go: fresh snapshots decide again (a drained
            # node's RSS no longer grows, so an old mark held it out until a restart).
            for node in self.nodes.values():
                node.leak_mark = None
        self._config = config
        self._dirty = True
        if not config.health.enabled:
            for node in self.nodes.values():
                node.health_ok = True
                if node.ready_since is None:
                    node.ready_since = self._clock()
        if config.discovery.mode == "dns":
            return [], []
        wanted = {n.name: n for n in config.nodes}
        removed = [name for name in self.nodes if name not in wanted]
        for name in removed:
            self.remove(name)
        added = [n.name for n in config.nodes if self._apply(n, ready)]
        return added, removed

    def _apply(self, node_config: NodeConfig, ready: Mapping[str, Node]) -> bool:
        """A member as ``node_config`` says: unchanged, it keeps everything; a new URL or
        sidecar (another server) starts afresh (as ``ready``'s node, already checked, when it
        has one); otherwise its weight, models and tags follow. True when added or replaced."""
        name = node_config.name
        current = self.nodes.get(name)
        if current is not None and current.config == node_config:
            return False
        if current is None or self._another(node_config):
            self.remove(name)
            fresh = ready.get(name)
            if fresh is None or fresh.config != node_config:
                fresh = self.make(node_config)
            self.nodes[name] = fresh
            self._dirty = True
            return True
        current.config = node_config
        view = current.view
        view.weight = node_config.weight
        view.models = current.models
        held = current.snapshot
        view.tags = frozenset(node_config.tags) or frozenset(held.tags if held else ())
        self._dirty = True
        return False

    # -- evidence --------------------------------------------------------------------------
    def record_health(self, node: Node, ok: bool, detail: str, now: float) -> None:
        """Envoy's thresholds: a node flips only after ``*_threshold`` results in a row; the
        first result of a node that was never checked counts at once."""
        health = self._config.health
        if node.health_ok is None:
            node.health_ok, node.health_streak = ok, 0
        elif ok == node.health_ok:
            node.health_streak = 0
        else:
            node.health_streak += 1
            if node.health_streak >= (
                health.healthy_threshold if ok else health.unhealthy_threshold
            ):
                node.health_ok, node.health_streak = ok, 0
                if (
                    ok
                    and node.leak_mark is not None
                    and now - node.snapshot_at > self._config.stale_after
                ):
                    # Down and back up with no snapshot to say more: its model server restarted
                    # (after the OOM the mark foretold, say). Only a snapshot cleared the mark,
                    # and a node whose sidecar was gone for good stayed drained for good. With
                    # one, its next snapshot decides (a blip of failed checks is no restart).
                    node.leak_mark = None
                    self._dirty = True
                    log.info("node %s: back up after a leak drain, back in", node.name)
                if ok and node.ejected_until:
                    # Envoy's successful_active_health_check_uneject_host: a node that was
                    # ejected, went unhealthy and passes its checks again is back.
                    node.ejected_until = 0.0
                    log.info("node %s: back from ejection (its health checks pass)", node.name)
        node.health_detail = detail
        if node.health_ok and node.ready_since is None:
            node.ready_since = now if self.settled else now - self._config.slow_start
        elif not node.health_ok:
            node.ready_since = None
        self._relist(node, now)

    def _state_at(self, node: Node, now: float) -> tuple[str, str]:
        """What the candidate lists are built from: the node's state, and the state it would
        be in but for an ejection (an ejected model's last node is kept while that is ready)."""
        stale, oom = self._config.stale_after, self._config.outlier.drain_before_oom
        state = node.state(now, stale, oom)
        # Only an ejection comes before the rest of the rule: otherwise the two are one.
        return state, node.state(now, stale, oom, ejection=False) if state == "ejected" else state

    def _relist(self, node: Node, now: float) -> None:
        """The lists are rebuilt when ``node`` is now in another state than they were built
        with: not when it was in another just before (a held snapshot gone stale since read
        as ready before and after a warm one, and a warming node stayed out)."""
        if self._state_at(node, now) != node.listed:
            self._dirty = True

    def record_snapshot(self, node: Node, snapshot: Snapshot, now: float) -> bool:
        """Take a snapshot unless it is older than the one held (same boot, lower seq).

        The candidate lists are rebuilt only when the node's state, models or tags change:
        they hold the views, which strategies read the new snapshot from at once. Rebuilt on
        every snapshot, a 1,000-node table was rebuilt (1.4 ms) before nearly every pick while
        a gossip round's snapshots came in, and so was each wrapper's narrowing of it."""
        held = node.snapshot
        if held is not None and held.boot == snapshot.boot and snapshot.seq < held.seq:
            return False
        was_serving = held is not None and held.ready and held.warm and not held.draining
        self._watch_leak(node, snapshot, now)
        # The engine's reading sent again (a sidecar keeps its last one through late scrapes,
        # and its other collectors' news comes under new seqs): its queue is still that of
        # the moment it was read, so the count of ours since then stands.
        again = snapshot.same_reading(held)
        node.snapshot, node.snapshot_at = snapshot, now
        view = node.view
        view.snapshot = snapshot  # fresh: `tick` would take it, with a rebuild
        if not again:
            view.in_flight_at_snapshot = view.in_flight
            view.others_since_snapshot = 0
        if snapshot.models and not node.config.models:
            learnt = frozenset(snapshot.models)
            if learnt != node.learnt_models:
                self._dirty = True
            node.learnt_models = learnt
            view.models = learnt
        if snapshot.tags and not node.config.tags:
            tags = frozenset(snapshot.tags)
            if tags != view.tags:
                view.tags = tags
                self._dirty = True  # new lists: a wrapper keeps its narrowing per list
        view.tier = snapshot.tier
        engine = snapshot.engine
        if engine is not None and engine.running and engine.tps and not again:
            rate = engine.tps / engine.running
            node.decode_rate = _ewma(node.decode_rate, rate)
        serving = snapshot.ready and snapshot.warm and not snapshot.draining
        if serving and not was_serving and held is not None:
            node.ready_since = now  # it just finished warming: ramp up from here
        # (The view now carries the snapshot, so `tick` sees no staleness end: `_relist`.)
        self._relist(node, now)
        return True

    def _watch_leak(self, node: Node, snapshot: Snapshot, now: float) -> None:
        mark = leak_mark(node.leak_mark, snapshot, self._config.outlier.drain_before_oom)
        if mark == node.leak_mark:
            return
        if mark is None and node.ready_since is not None:
            # Back from a drain: ramped up from here, as a node back from any other (it came
            # back at its full share at once, a restarted server cold in all but name). One
            # not healthy ramps up when its checks pass again, as always.
            node.ready_since = now
        node.leak_mark = mark
        self._dirty = True
        if mark is not None:
            log.warning(
                "node %s: draining, its model server runs out of memory in %.0fs at %.1f MB/s",
                node.name,
                snapshot.seconds_to_oom() or 0.0,
                (snapshot.rss_slope or 0.0) / 2**20,
            )
        else:
            log.info("node %s: restarted or its memory freed, back in", node.name)

    def record_result(
        self, node: Node, ok: bool, latency_s: float | None, ttft_s: float | None, now: float
    ) -> None:
        """A finished try. Failures in a row may eject the node (Envoy's outlier detection)."""
        view = node.view
        node.requests += 1
        _fade(node, now)  # the rate as of now, before this answer moves it
        view.error_rate = after_try(view.error_rate, ok)
        if latency_s is not None:
            view.ewma_latency_s = _ewma(view.ewma_latency_s, latency_s)
            node.recent_latency_s.append(latency_s)
        if ttft_s is not None:
            view.ewma_ttft_s = _ewma(view.ewma_ttft_s, ttft_s)
            node.recent_ttft_s.append(ttft_s)
        outlier = self._config.outlier
        if ok:
            node.consecutive_failures = 0
            back, base = node.ready_since, outlier.base_ejection_time
            if eases(node.times_ejected, back, node.eased_at, now, base):
                node.times_ejected -= 1
                node.eased_at = now
            return
        node.failures += 1
        if now < node.ejected_until:
            # Tries under way when it was ejected, failing now: not a new streak (one crash
            # with 20 streams open ejected it again and again: 30, 60, 90, 120 s).
            node.consecutive_failures = 0
            return
        node.consecutive_failures += 1
        if node.consecutive_failures >= outlier.consecutive_failures and self._may_eject(node, now):
            node.times_ejected += 1
            seconds = ejection_time(
                node.times_ejected, outlier.base_ejection_time, outlier.max_ejection_time
            )
            node.ejected_until = now + seconds
            log.warning(
                "node %s: ejected for %gs after %d failures in a row (ejection %d)",
                node.name,
                seconds,
                node.consecutive_failures,
                node.times_ejected,
            )
            node.consecutive_failures = 0
            node.ready_since = None
            self._dirty = True

    def record_request_fault(self, node: Node) -> None:
        """A try that failed through the request itself: neither a success nor a failure of
        the node's, so its error rate and failure streak stay as they were."""
        node.request_faults += 1

    def _may_eject(self, node: Node, now: float) -> bool:
        """Whether ejecting ``node`` keeps every model it serves within the cap of ejected
        nodes: each model's own pool (its nodes and those that name no model, which take any;
        see `_rebuild`), not their union, which let both nodes of a two-node model go while a
        model they shared one of had room. A node that names no model is in every model's pool
        and in the pool of models no node names (model-less nodes each with an empty pool of
        their own could all be ejected at once). One pass over the nodes: asked on every
        failure of a node the cap holds back."""
        size: dict[str, int] = {}
        out: dict[str, int] = {}
        any_size = any_out = 0  # the nodes that name no model
        for n in self.nodes.values():
            gone = 1 if now < n.ejected_until else 0
            if not n.models:
                any_size += 1
                any_out += gone
            for name in n.models:
                size[name] = size.get(name, 0) + 1
                out[name] = out.get(name, 0) + gone
        # "" stands for the models no node names: their pool is the model-less nodes alone.
        models: list[str] = list(node.models) if node.models else [*size, ""]
        percent = self._config.outlier.max_ejection_percent
        for model in models:
            pool = any_size + size.get(model, 0)
            if any_out + out.get(model, 0) >= ejection_cap(pool, percent):
                return False
        return True

    # -- the hot path ----------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Time passes: snapshots go stale, ejections end, slow start ramps. Called by the
        background loop about once a second, and after each change."""
        stale_after = self._config.stale_after
        slow_start = self._config.slow_start
        for node in self.nodes.values():
            view = node.view
            _fade(node, now)
            fresh = node.snapshot if now - node.snapshot_at <= stale_after else None
            if fresh is not view.snapshot:
                view.snapshot = fresh
                self._dirty = True
            if node.ejected_until and now >= node.ejected_until:
                node.ejected_until = 0.0
                node.ready_since = now
                self._dirty = True
                log.info("node %s: back from ejection, ramping up", node.name)
            since = node.ready_since
            view.ramp = 1.0 if since is None else ramp(now - since, slow_start)
        if self._dirty:
            self._rebuild(now)

    def _rebuild(self, now: float) -> None:
        leaking: list[Node] = []
        ejected: list[Node] = []  # out only for their ejection: their health checks pass
        candidates: dict[str, list[NodeView]] = {}
        known: set[str] = set()
        # A node that names no model (none configured, none learnt yet) takes any model.
        wildcard: list[NodeView] = []
        self._any_wildcard = False
        for node in self.nodes.values():
            known.update(node.models)
            self._any_wildcard |= not node.models
            node.listed = self._state_at(node, now)
            state, unejected = node.listed
            if state == "leaking":
                leaking.append(node)
            elif state == "ejected":
                if unejected == "ready":
                    ejected.append(node)
            elif state == "ready":
                for model in node.models:
                    candidates.setdefault(model, []).append(node.view)
                if not node.models:
                    wildcard.append(node.view)
        for views in candidates.values():
            views.extend(wildcard)
        for kept in (leaking, ejected):
            if not kept or wildcard:
                continue
            # Drained or ejected while others serve its models; a model with no other node
            # keeps them. A node near its OOM beats none; so does an ejected one whose health
            # checks pass (Envoy's panic routing: a one-node model was a 503, or its fallback,
            # for the whole ejection, 30 s and more, after five failures in a row).
            bare = {m for node in kept for m in node.models if not candidates.get(m)}
            for node in kept:
                for model in node.models & bare:
                    candidates.setdefault(model, []).append(node.view)
            # Those that name no model take any, as the ready ones would: a cluster of such
            # nodes was a 503 for the whole ejection.
            wildcard = [node.view for node in kept if not node.models]
        self._candidates = candidates
        self._serving = None  # built when a scrape asks: not on the request's path
        self._wildcard = wildcard
        self._known_models = known
        self._dirty = False

    def candidates(self, model: str) -> Sequence[NodeView] | None:
        """The nodes that may take a request for ``model`` now; ``None`` if no node serves it."""
        if self._dirty:
            self.tick(self._clock())
        found = self._candidates.get(model)
        if found is not None:
            return found
        if self._any_wildcard:
            return self._wildcard
        return () if model in self._known_models else None

    def names_model(self, model: str) -> bool:
        """Whether some node names ``model`` (configured or learnt from its snapshots): a
        node that names none takes any, so a request's model may be anything the client sent."""
        if self._dirty:
            self.tick(self._clock())
        return model in self._known_models

    def state_of(self, node: Node) -> str:
        oom_within = self._config.outlier.drain_before_oom
        return node.state(self._clock(), self._config.stale_after, oom_within)

    def serving(self, node: Node) -> bool:
        """Whether ``node`` takes requests now: ready, or kept for a model that has no other
        node (ejected but passing its health checks, or drained for a leak)."""
        if self._dirty:
            self.tick(self._clock())
        if self._serving is None:
            self._serving = {v.name for views in self._candidates.values() for v in views}
            self._serving.update(v.name for v in self._wildcard)
        return node.name in self._serving

    def ready_models(self) -> list[str]:
        if self._dirty:
            self.tick(self._clock())
        return sorted(self._candidates)


def _fade(node: Node, now: float) -> None:
    since = node.faded_at
    if since is not None and now <= since:
        return
    node.faded_at = now
    view = node.view
    if view.error_rate and since is not None:  # every request passes here: most have none
        view.error_rate = faded(view.error_rate, now - since)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + _EWMA * (new - old)


def leak_mark(
    mark: tuple[str, int] | None, snapshot: Snapshot, oom_within: float
) -> tuple[str, int] | None:
    """A node's leak mark (its boot and RSS when marked) after ``snapshot``: set when its model
    server is projected out of memory within ``oom_within`` seconds, which drains it, and kept
    until it restarts (a new boot) or its RSS falls back: once drained its RSS stops growing,
    and going by the slope alone would bring it back a window later, to leak again. The
    simulator keeps its replicas' marks by this rule too."""
    if mark is None:
        # A model server that loads or warms up grows by gigabytes, and no such snapshot
        # routes traffic: marked from one, the node would flap (its next not-warm snapshot
        # clears the mark) and stay "leaking" once warm, with no growth left to end it.
        if snapshot.ready and snapshot.warm and _leaking(snapshot, oom_within):
            return (snapshot.boot, snapshot.rss or 0)
        return None
    boot, rss = mark
    # A restarted model server shows as a new boot (the sidecar restarted too) or as not
    # warm (the sidecar saw a new process and warms it again).
    restarted = snapshot.boot != boot or not snapshot.warm
    if restarted or (snapshot.rss is not None and snapshot.rss < 0.9 * rss):
        return None
    return mark


def _leaking(snapshot: Snapshot, oom_within: float) -> bool:
    left = snapshot.seconds_to_oom()
    return left is not None and left < oom_within
