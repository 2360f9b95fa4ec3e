"""The simulator's engine: emulated node queues on a virtual clock, routed by the real strategies.

One run replays an arrival trace against a list of `NodeSpec` with one routing policy and returns
the raw outcome (`SimResult`); `_sim` turns runs into the report. Nothing here sleeps or awaits:
events sit in a heap keyed by virtual time, and the trace (already sorted) is merged with it.

The node is the emulator's (``emulator/_capacity.py``, ``_app.py``): ``slots`` requests are
served at once, the rest wait in a FIFO queue, and a request takes
``(ttft_ms / 1000 + prompt_tokens / prefill_tokens_per_s + max_tokens / tokens_per_s) * factor``
seconds, its first token (and, streaming, its response headers) coming after the first two terms.
``factor`` is the ``slow`` fault's when the request reached the node: the emulator reads its
``slow_factor`` once per request, on admission, so a change applies to requests that come after.
``crash`` drops everything on the node and refuses connections until ``recover``; ``hang``
holds new requests at admission, out of the engine's counts (work already admitted goes on),
until ``recover`` lifts it and they go on in order, as the emulator's runtime hang does;
``recover`` also sets the factor back to 1. ``leak`` costs memory, not time: on a node with a
``memory_limit_mb`` its sidecar's RSS, slope and free memory (`_simleak`) reach the replicas,
which drain it by the middleware's rule (`middleware._nodes.leak_mark`). A prompt and answer past
the node's context (its KV cache's tokens, ``EmulatorConfig.context_tokens``) is the emulator's
400 at once: the request's, never retried.

The middleware is each replica's ``Balancer.open`` and ``NodeTable``, on virtual time:

* ``replicas`` replicas, each with its own strategy object, random generator and `NodeView` per
  node; arrivals go to the replicas in turn, as a round-robin L4 balancer in front would send them.
* A replica's ``in_flight`` is exact (its own tries); the engine's running/waiting and tokens/s
  (of the requests past their first token, each at its rate) reach it as a `Snapshot`
  refreshed every ``staleness`` seconds, the replicas' phases staggered over the
  period. ``in_flight_at_snapshot`` is set at each refresh, as ``NodeTable.record_snapshot`` does.
* Tries: up to ``attempts``, never the same node twice, retried on a refused connection, a reset
  before the headers and the per-try timeout to the headers, within the retry budget (retries in
  flight below ``max(budget_min, budget_percent% of active requests)``). A stream that breaks
  after its first byte is not retried.
* Health checks, ``health_interval`` apart and staggered per replica, take a crashed node out of
  the candidates after ``unhealthy_threshold`` failures and back after ``healthy_threshold``
  passes; ``outlier_failures`` failed tries in a row eject a node for ``30 s x times ejected``
  (at most 300 s, at most half the nodes). A node back from either ramps up over ``slow_start``.
  A model with no node left keeps the leaking ones, else the ejected ones whose health checks
  pass, as ``NodeTable`` does (Envoy's panic routing).
  The retry budget, the ejection times and cap and the ramp are the middleware's own rules
  (``middleware/_rules.py``), not copies.
* The client (the benchmark's load generator) gives up ``client_timeout`` after the arrival.

``perfect`` is not a strategy object but the bound: one dispatcher with exact, instant knowledge
of every queue (join the shortest expected delay). ``oracle`` is the same dispatcher that also
knows every node's KV cache: for requests that carry their prompt (``prepared``), each node
keeps the emulator's own `KVCache`, a request's blocks are looked up when it gets its slot and
held while it runs, and its time to first token is ``ttft_ms`` plus its uncached prompt tokens
over ``prefill_tokens_per_s``, as the emulator computes it. ``random`` is a simulator-only
baseline.

The engine is split by concern: `_simparams` (inputs and outputs), `_simnode` and `_simreplica`
(state), `_simbase` (the event heap), and the events' mixins `_simdetect` (what replicas learn),
`_simperfect` (the bound), `_simtries` (a request's tries) and `_simfaults`; this module runs the
loop.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from promptlb.shared import ConfigError

from ._scenario import Arrival, NodeSpec
from ._simbase import (
    CONNECT_FAIL,
    DETECT,
    FAULT,
    FINISH,
    HEADERS,
    KV_SAMPLE,
    MARK,
    REFRESH,
    SHARE,
    TIMEOUT,
    UNEJECT,
)
from ._simfaults import Faults
from ._simnode import Req
from ._simparams import ORACLE, PERFECT, RANDOM, SIM_STRATEGIES, ServiceFn, SimParams, SimResult
from ._simprompt import Prompted, Read
from ._simreplica import RandomChoice

__all__ = [
    "ORACLE",
    "PERFECT",
    "RANDOM",
    "SIM_STRATEGIES",
    "RandomChoice",
    "ServiceFn",
    "SimParams",
    "SimResult",
    "simulate",
]


class _Sim(Faults):
    def _mark(self, now: float) -> None:
        for node in self.nodes:
            node.busy_mark = node.busy + node.running * (now - node.t_last)

    def run(self) -> SimResult:
        started = time.perf_counter()
        if self.perfect:
            for node in self.nodes:
                self._join_group(node)
        arrivals = self.arrivals
        total = len(arrivals)
        heap = self.heap
        pop = heapq.heappop
        push = heapq.heappush
        count = len(self.replicas) or 1
        replicas = self.replicas
        perfect = self.perfect
        prepared = self.prepared
        reads = self.reads
        keyed = self.keyed
        refresh = self.params.staleness
        share_every = self.share_every
        seq = self.seq
        i = 0
        events = 0
        next_at = arrivals[0].at if total else math.inf
        while True:
            if heap and heap[0][0] <= next_at:
                t, _, kind, obj, try_no = pop(heap)
                events += 1
                if kind == FINISH:
                    self._finish(t, obj, try_no)
                elif kind == TIMEOUT:
                    self._timeout(t, obj, try_no)
                elif kind == REFRESH:
                    self._refresh(replicas[obj], t)
                    push(heap, (t + refresh, next(seq), REFRESH, obj, 0))
                elif kind == KV_SAMPLE:
                    for node in self.nodes:
                        kv = node.kv
                        self.kv_use[node.name].append(round(kv.filled, 3) if kv else 0.0)
                    if t + 1.0 < self.duration:
                        push(heap, (t + 1.0, next(seq), KV_SAMPLE, None, 0))
                elif kind == SHARE:
                    self._share(obj)
                    push(heap, (t + share_every, next(seq), SHARE, obj, 0))
                elif kind == CONNECT_FAIL:
                    req: Req = obj
                    if not req.done and req.try_no == try_no:
                        self._try_failed(req, "connect", t)
                elif kind == DETECT:
                    self._detect(obj, t)
                elif kind == HEADERS:
                    self._headers(obj, try_no)
                elif kind == UNEJECT:
                    self._uneject(obj, try_no, t)
                elif kind == FAULT:
                    self._fault(obj[0], obj[1], t)
                elif kind == MARK:
                    self._mark(t)
                if self.pending == 0 and i >= total:
                    break
            elif i < total:
                arrival = arrivals[i]
                r = i % count
                prompted = prepared[i] if prepared is not None else None
                if perfect:
                    req = Req(arrival, 0, None, prompted)
                else:
                    route = reads[i].keyed if keyed else reads[i].route  # the body sent, read
                    req = Req(arrival, r, route, prompted)
                    replicas[r].budget.active += 1
                i += 1
                next_at = arrivals[i].at if i < total else math.inf
                self.pending += 1
                self._route(req, req.born)
                events += 1
            else:
                break
        for node in self.nodes:
            if node.busy_mark < 0:  # drained before the end of the trace's window
                node.busy_mark = node.busy + node.running * (self.duration - node.t_last)
        counts = [node.cache_counts() for node in self.nodes]
        return SimResult(
            strategy=self.name,
            requests=total,
            latencies=self.latencies,
            waits=self.waits,
            ttfts=self.ttfts,
            query_tokens=sum(q for q, _ in counts),
            hit_tokens=sum(h for _, h in counts),
            kv_use=self.kv_use,
            errors=dict(sorted(self.errors.items())),
            retries=self.retries,
            ejections=self.ejections,
            node_names=[n.name for n in self.nodes],
            dispatched=[n.dispatched for n in self.nodes],
            served=[n.served for n in self.nodes],
            busy=[n.busy_mark for n in self.nodes],
            slots=[n.slots for n in self.nodes],
            max_depth=[n.max_depth for n in self.nodes],
            duration=self.duration,
            makespan=self.last_t,
            in_window=self.in_window,
            wall_s=time.perf_counter() - started,
            events=events,
        )


def simulate(
    nodes: Sequence[NodeSpec],
    arrivals: Sequence[Arrival],
    strategy: str,
    *,
    duration: float,
    params: SimParams | None = None,
    options: Mapping[str, Any] | None = None,
    service: ServiceFn | None = None,
    prepared: Sequence[Prompted | None] | None = None,
    reads: Sequence[Read] | None = None,
) -> SimResult:
    """Replay ``arrivals`` (sorted by time) on ``nodes`` routed by ``strategy``.

    ``strategy`` is a middleware strategy name (built with ``options``; ``X+affinity`` under
    ``[affinity]``), ``random``, ``perfect`` or ``oracle``. ``prepared`` (`_simprompt.prepare`
    of ``arrivals``) gives requests their prompt: nodes then keep KV caches. ``reads``
    (`_simprompt.read` of ``arrivals``, made here if not given) is the gateway's view of each
    request, which strategies route on. ``duration`` is the trace's window: utilisation is
    measured within it, while the run goes on until every request has finished or failed.
    Deterministic for ``params.seed``.
    """
    if not nodes:
        raise ConfigError("nodes", [], "at least one node")
    params = params or SimParams()
    sim = _Sim(nodes, arrivals, strategy, duration, params, options or {}, service, prepared, reads)
    return sim.run()
