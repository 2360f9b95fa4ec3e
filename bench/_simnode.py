"""The simulator's node and request state: the emulator's capacity model (``slots`` served at
once, a FIFO queue behind them), a request across its tries, and the perfect dispatcher's
groups of alike nodes. Plain state with the two computations every event needs; the events
that change it are `_simtries`' and `_simfaults`'."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

from promptlb.emulator._kv import KVCache, Lease
from promptlb.middleware._view import RouteRequest
from promptlb.shared import BLOCK_TOKENS, EngineSample, Snapshot

from ._scenario import Arrival, NodeSpec
from ._simleak import Memory
from ._simprompt import Prompted, context_tokens, kv_capacity
from ._simreplica import View

__all__ = [
    "CONNECTING",
    "CRASHED",
    "HUNG",
    "QUEUED",
    "RUNNING",
    "STUCK",
    "UP",
    "Group",
    "Node",
    "Req",
]

UP, CRASHED, HUNG = 0, 1, 2  # a node's state
CONNECTING, QUEUED, RUNNING, STUCK = 0, 1, 2, 3  # a try's phase; STUCK: on a hung node


class Req:
    """One request of the trace, across its tries. Per-try fields are reset by `Tries._send`."""

    __slots__ = (
        "armed",
        "arrival",
        "base",
        "born",
        "cut",
        "deadline",
        "done",
        "factor",
        "finish",
        "head",
        "last",
        "lease",
        "node",
        "phase",
        "prompted",
        "queued",
        "replica",
        "retry_try",
        "route",
        "sent",
        "start",
        "tried",
        "try_no",
        "view",
    )

    def __init__(
        self,
        arrival: Arrival,
        replica: int,
        route: RouteRequest | None,
        prompted: Prompted | None = None,
    ) -> None:
        self.arrival = arrival
        self.prompted = prompted  # its prompt's blocks, when the scenario gives prompts
        self.lease: Lease | None = None  # its hold on the node's KV cache while it runs
        self.born = arrival.at
        self.replica = replica
        self.route = route
        self.tried: list[int] = []
        self.try_no = 0
        self.done = False
        self.last = "no_node"  # why the latest try failed
        self.view: View | None = None
        self.node: Node | None = None
        self.phase = CONNECTING
        self.retry_try = False  # this try is a retry: it holds a place in the retry budget
        self.armed = False  # a per-try timeout event is pending for this try
        self.cut = False  # the client gives up before this try would finish
        self.sent = 0.0
        self.deadline = 0.0
        self.start = 0.0
        self.base = 0.0  # service seconds at slow factor 1
        self.factor = 1.0  # the node's slow factor when this try reached it
        self.head = 0.0  # of which before the first token
        self.finish = 0.0
        self.queued = 0  # the view's effective queue when this try was picked


class Group:
    """Nodes with the same service-time parameters, for the perfect dispatcher: within a group
    the node whose earliest free slot comes first is the best, so one heap per group suffices."""

    __slots__ = ("a", "b", "c", "heap", "members")

    def __init__(self, spec: NodeSpec, factor: float) -> None:
        self.a = spec.ttft_ms / 1000 * factor
        self.b = factor / spec.tokens_per_s
        self.c = factor / spec.prefill_tokens_per_s if spec.prefill_tokens_per_s else 0.0
        # (earliest free slot, node version, node index): stale entries are skipped on read.
        self.heap: list[tuple[float, int, int]] = []
        self.members: set[int] = set()


class Node:
    __slots__ = (
        "active",
        "busy",
        "busy_mark",
        "context",
        "cur",
        "cur_until",
        "dispatched",
        "factor",
        "free",
        "group",
        "hit_tokens",
        "hung",
        "idx",
        "inv_prefill",
        "inv_tps",
        "issued",
        "issued_at",
        "issued_from",
        "kv",
        "max_depth",
        "memory",
        "name",
        "query_tokens",
        "queue",
        "running",
        "served",
        "slots",
        "snaps",
        "spec",
        "stale",
        "state",
        "state_since",
        "t_last",
        "ttft",
        "version",
    )

    def __init__(self, idx: int, spec: NodeSpec, kv: bool = False) -> None:
        self.idx = idx
        self.spec = spec
        self.name = spec.name
        self.slots = spec.slots
        self.ttft = spec.ttft_ms / 1000
        self.inv_tps = 1.0 / spec.tokens_per_s
        self.inv_prefill = 1.0 / spec.prefill_tokens_per_s if spec.prefill_tokens_per_s else 0.0
        self.factor = 1.0
        self.state = UP
        self.state_since = 0.0  # when it last crashed or came back: what health checks see
        self.running = 0
        self.queue: deque[Req] = deque()
        # Queue entries whose try has ended (timed out, failed): left in place and skipped at
        # the head, which keeps giving up O(1). The engine's waiting count leaves them out.
        self.stale = 0
        # Running tries, in the order they started: a dict, not a set, so that iterating it (a
        # crash, a slow fault) is the same from run to run, and so are the results.
        self.active: dict[Req, None] = {}
        self.hung: list[Req] = []
        self.busy = 0.0
        self.busy_mark = -1.0
        self.t_last = 0.0
        self.served = 0
        self.dispatched = 0
        self.max_depth = 0
        # Snapshots interned by (running, waiting, tokens/s): strategies read only the engine's
        # numbers, and the same object for the same numbers keeps `Resource`'s cache warm.
        self.snaps: dict[tuple[int, int, float, float | None], Snapshot] = {}
        # The snapshot of the counts now, or None once they changed: replicas refresh every
        # node every period, and most nodes' counts have not moved since the last replica did.
        self.cur: Snapshot | None = None
        # ... and until when it holds with no event: a running request reaching its first
        # token moves tokens/s (the engine's counter) though no count changed.
        self.cur_until = math.inf
        # The copy of ``issued_from`` handed to the replicas at their ``issued_at``-th refresh
        # (`Detection._refresh`): each refresh a new snapshot, as live.
        self.issued: Snapshot | None = None
        self.issued_from: Snapshot | None = None
        self.issued_at = 0
        self.free: list[float] = [0.0] * spec.slots  # perfect only: when each slot frees up
        self.group: Group | None = None
        self.version = 0
        # The emulator's KV cache, when requests carry their prompt's blocks; its counters
        # are summed here when a crash takes it (the emulator's process starts empty).
        self.kv: KVCache | None = KVCache(kv_capacity(spec)) if kv else None
        self.query_tokens = 0
        self.hit_tokens = 0
        self.context = context_tokens(spec)  # prompt and answer at most: else a 400
        # Its model server's memory against the scenario's limit, for the leak drain.
        limit = spec.memory_limit_mb
        self.memory: Memory | None = None if limit is None else Memory(limit)

    def lose_cache(self) -> None:
        """A crash: the engine's cache is gone with its process."""
        kv = self.kv
        if kv is not None:
            self.query_tokens += kv.query_tokens
            self.hit_tokens += kv.hit_tokens
            self.kv = KVCache(kv.capacity)

    def cache_counts(self) -> tuple[int, int]:
        """Prompt tokens looked up and found cached, over the run."""
        kv = self.kv
        if kv is None:
            return 0, 0
        return self.query_tokens + kv.query_tokens, self.hit_tokens + kv.hit_tokens

    def snapshot(self, now: float) -> Snapshot:
        waiting = len(self.queue) - self.stale
        # Tokens/s as the engine's counter shows it: only requests past their first token
        # decode, each at the rate its slow factor set.
        tps = 0.0
        until = math.inf
        for req in self.active:
            first = req.start + req.head * req.factor
            if first <= now:
                tps += 1.0 / req.factor
            elif first < until:
                until = first
        tps = round(tps * self.spec.tokens_per_s, 1)
        # KV use as vLLM's gauge shows it (held blocks: cached ones no request holds count as
        # free), to the percent (snapshots stay interned).
        kv = None if self.kv is None else round(self.kv.usage, 2)
        key = (self.running, waiting, tps, kv)
        snap = self.snaps.get(key)
        if snap is None:
            snap = Snapshot(
                node=self.name,
                boot="sim",
                seq=0,
                ts=0.0,
                ready=True,
                warm=True,
                engine=EngineSample(
                    running=self.running,
                    waiting=waiting,
                    tps=tps,
                    kv_cache=kv,
                    kv_tokens=None if self.kv is None else self.kv.capacity * BLOCK_TOKENS,
                ),
            )
            self.snaps[key] = snap
        memory = self.memory
        if memory is not None:
            rss, slope, free = memory.reading(now)
            boot = f"sim-{memory.boot}"  # a new process after a crash, as a new sidecar's
            snap = replace(snap, boot=boot, rss=rss, rss_slope=slope, mem_free=free)
            if memory.changing:
                until = now  # the slope's window slides: read it again at the next refresh
        self.cur = snap
        self.cur_until = until
        return snap

    def integrate(self, now: float) -> None:
        self.busy += self.running * (now - self.t_last)
        self.t_last = now
