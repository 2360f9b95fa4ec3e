"""A request's tries, from the pick to the last token: the middleware's `Balancer.open` (never
the same node twice, within the retry budget) and the emulated node's slots and FIFO queue, with
the per-try and client timeouts. A try that fails before its headers is retried elsewhere."""

from __future__ import annotations

import contextlib
import heapq

from promptlb.emulator._kv import prefilled
from promptlb.middleware._refusals import NoNodeAvailable

from ._simbase import CONNECT_FAIL, FINISH, HEADERS, TIMEOUT
from ._simdetect import Detection
from ._simnode import CONNECTING, CRASHED, HUNG, QUEUED, RUNNING, STUCK, Node, Req
from ._simperfect import Perfect
from ._simprompt import engine_tokens
from ._simreplica import View

__all__ = ["Tries"]

# A filler prompt's chat template, in tokens, at most: past the context less this, its
# engine's count is worked out (`engine_tokens`) before refusing it.
_TEMPLATE_TOKENS = 16


class Tries(Perfect, Detection):
    def _end_try(self, req: Req) -> None:
        """The try is over, whatever its outcome: the replica's counts let go of it."""
        view = req.view
        if view is not None:
            view.in_flight -= 1
            req.view = None
            index = self.replicas[req.replica].strategy.prefix_index
            if index is not None:  # for the other replicas, as the balancer tells it
                index.finished(view.name)
        if req.retry_try:
            req.retry_try = False
            self.replicas[req.replica].budget.retrying -= 1

    def _fail(self, req: Req, kind: str, when: float) -> None:
        self._end_try(req)
        req.done = True
        if not self.perfect:
            self.replicas[req.replica].budget.active -= 1
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.pending -= 1
        if when > self.last_t:
            self.last_t = when

    def _refused(self, req: Req, node: Node, now: float) -> None:
        """The node's 400 at once: the request's fault, passed on and never retried, and an
        answer as far as the node's health goes; the strategy is told of it as the balancer
        tells it (`Strategy.refused`)."""
        if not self.perfect:
            route, view = req.route, req.view
            if route is not None and view is not None:
                self.replicas[req.replica].strategy.refused(route, view)
            self._record(req.replica, node.idx, ok=True, now=now)
        self._fail(req, "bad_request", now)

    def _try_failed(self, req: Req, kind: str, now: float) -> None:
        """A try failed before its headers: the proxy tries another node if it may."""
        node = req.node
        self._end_try(req)
        if now >= req.born + self.params.client_timeout:
            # The client has given up (the try's deadline was the client's): the gateway
            # cancels the try and counts it against no node, as a cut stream in `_finish`.
            self._fail(req, "timeout", now)
            return
        if node is not None and not self.perfect:
            self._record(req.replica, node.idx, ok=False, now=now)
        req.last = kind
        if len(req.tried) >= self.params.attempts:
            self._fail(req, kind, now)
        else:
            self._route(req, now)

    def _route(self, req: Req, now: float) -> None:
        tried = req.tried
        if self.perfect:
            if self.oracle:
                best = self._oracle_pick(req, now, tried)
            else:
                best = self._perfect_pick(req.arrival, now, tried)
            if best is None:
                self._fail(req, req.last, now)
                return
            if tried:
                self.retries += 1
            tried.append(best.idx)
            self._send(req, best, now, None)
            return
        replica = self.replicas[req.replica]
        if self.params.staleness == 0:
            self._refresh(replica, now)
        cands: list[View] = replica.cands
        if tried:
            # Rare (retries only): never the same node twice, as Balancer.open.
            cands = cands.copy()  # copy and remove run in C: a 1,000-node list costs microseconds
            views = replica.views
            for idx in tried:
                with contextlib.suppress(ValueError):
                    cands.remove(views[idx])
            if not cands or not replica.budget.allow():
                self._fail(req, req.last, now)
                return
        route = req.route
        assert route is not None
        try:
            view = replica.strategy.pick(route, cands, replica.rng)
        except NoNodeAvailable:
            self._fail(req, req.last, now)
            return
        assert isinstance(view, View)
        req.queued = view.effective_queue
        view.in_flight += 1
        if tried:
            replica.budget.retrying += 1
            req.retry_try = True
            self.retries += 1
        tried.append(view.idx)
        self._send(req, self.nodes[view.idx], now, view)

    def _send(self, req: Req, node: Node, now: float, view: View | None) -> None:
        params = self.params
        req.view = view
        req.node = node
        req.sent = now
        req.try_no += 1
        req.armed = False
        req.cut = False
        req.deadline = min(now + params.per_try_timeout, req.born + params.client_timeout)
        if node.state == CRASHED:
            req.phase = CONNECTING
            self._push(now + params.connect_fail_s, CONNECT_FAIL, req, req.try_no)
            return
        node.dispatched += 1
        req.factor = node.factor
        arrival = req.arrival
        if self.service is None:
            # With a KV cache the head is known when the slot is taken (`_start`); the perfect
            # dispatchers' forecast takes what is cached now.
            head = node.ttft + self._uncached(req, node) * node.inv_prefill
            req.head = head
            req.base = head + arrival.max_tokens * node.inv_tps
        else:
            req.head = 0.0
            req.base = self.service(node.spec, arrival, self.service_rng)
        if node.state == HUNG:
            # The emulator's hang: accepted, never answered, and not in the engine's counts.
            req.phase = STUCK
            node.hung.append(req)
            req.armed = True
            self._push(req.deadline, TIMEOUT, req, req.try_no)
            return
        self._admit(req, node, now)

    def _admit(self, req: Req, node: Node, now: float) -> None:
        """Into a free slot, or at the back of the FIFO queue; as the emulator's handler goes
        on past a hang: its leak, then its 400 for a prompt and answer past the context."""
        memory = node.memory
        if memory is not None and memory.request(now):
            node.cur = None
        arrival = req.arrival
        prompted = req.prompted
        prompt = arrival.prompt_tokens if prompted is None else prompted.tokens
        if prompt + arrival.max_tokens + _TEMPLATE_TOKENS > node.context:
            if prompted is None:  # filler: counted as the emulator counts it, when it matters
                prompt = engine_tokens(arrival, self.params.model)
            if prompt + arrival.max_tokens > node.context:
                self._refused(req, node, now)
                return
        if self.perfect:
            free = node.free
            t0 = heapq.heappop(free)
            heapq.heappush(free, (t0 if t0 > now else now) + req.base * req.factor)
            self._reindex(node)
        if node.running < node.slots:
            self._start(req, node, now)
            if node.running > node.max_depth:
                node.max_depth = node.running
        else:
            req.phase = QUEUED
            node.queue.append(req)
            node.cur = None
            if not req.armed:
                req.armed = True
                heapq.heappush(self.heap, (req.deadline, next(self.seq), TIMEOUT, req, req.try_no))
            depth = node.running + len(node.queue) - node.stale
            if depth > node.max_depth:
                node.max_depth = depth

    def _start(self, req: Req, node: Node, now: float) -> None:
        node.busy += node.running * (now - node.t_last)
        node.t_last = now
        node.running += 1
        node.cur = None
        req.phase = RUNNING
        req.start = now
        node.active[req] = None
        prompted = req.prompted
        kv = node.kv
        if prompted is not None and kv is not None and self.service is None:
            # The emulator's order: the slot first, then the cache lookup and its hold.
            lease = req.lease = kv.start(prompted.blocks, prompted.tokens, req.arrival.max_tokens)
            base = req.base - req.head
            req.head = node.ttft + (prompted.tokens - lease.cached_tokens) * node.inv_prefill
            was, req.base = req.base, base + req.head
            if self.perfect and req.base != was:
                self._replanned = True
        factor = req.factor
        finish = now + req.base * factor
        give_up = req.born + self.params.client_timeout
        if finish > give_up:
            finish = give_up
            req.cut = True
        req.finish = finish
        heapq.heappush(self.heap, (finish, next(self.seq), FINISH, req, req.try_no))
        headers = now + req.head * factor
        if req.retry_try and headers <= req.deadline:
            # A retry holds its place in the budget until its headers come, as Balancer.open
            # keeps it until the node answers: a burst of resets is held to the budget.
            self._push(headers, HEADERS, req, req.try_no)
        if not req.armed and headers > req.deadline:
            req.armed = True
            self._push(req.deadline, TIMEOUT, req, req.try_no)
        if self._replanned:  # the forecast took another prefill: recompute it from the state
            self._replanned = False
            self._replan(node, now)

    def _release(self, req: Req, node: Node, now: float) -> None:
        """The try left its slot: its blocks stay cached, unpinned, those it computed if it
        left during its prefill (`KVCache.finish`, `prefilled`)."""
        lease = req.lease
        if lease is not None:
            req.lease = None
            if node.kv is not None:
                fixed = node.ttft * req.factor
                done = prefilled(now - req.start, fixed, req.head * req.factor - fixed)
                node.kv.finish(lease, done)

    def _next(self, node: Node, now: float) -> None:
        """Hand free slots to the queue's head, FIFO, skipping tries that already ended."""
        queue = node.queue
        while queue and node.running < node.slots:
            req = queue.popleft()
            if req.node is not node or req.phase != QUEUED or req.done:
                node.stale -= 1
                node.cur = None
                continue
            self._start(req, node, now)

    def _finish(self, t: float, req: Req, try_no: int) -> None:
        if req.done or req.try_no != try_no or req.phase != RUNNING or req.finish != t:
            return  # rescheduled by a slow fault, or the try already ended
        node = req.node
        assert node is not None
        node.busy += node.running * (t - node.t_last)
        node.t_last = t
        node.running -= 1
        node.cur = None
        del node.active[req]
        self._release(req, node, t)
        if req.cut:
            # The client gave up mid-stream and disconnected: the slot frees now. The gateway
            # counts an aborted request against no node.
            self._fail(req, "timeout", t)
            self._replan(node, t)
        else:
            view = req.view  # _end_try lets go of it
            self._end_try(req)
            req.done = True
            self.latencies.append(t - req.born)
            if t <= self.duration:
                self.in_window += 1
            self.waits.append(req.start - req.sent)
            self.ttfts.append(req.start + req.head * req.factor - req.born)
            node.served += 1
            self.pending -= 1
            self.last_t = t
            if not self.perfect:
                replica = self.replicas[req.replica]
                route = req.route
                if route is not None and view is not None:
                    # A custom service time has no first-token split: then none is reported.
                    head = None if self.service else req.start - req.sent + req.head * req.factor
                    replica.strategy.observe(route, view, t - req.sent, head, req.queued)
                replica.budget.active -= 1
                self._record(req.replica, node.idx, ok=True, now=t)
        self._next(node, t)

    def _headers(self, req: Req, try_no: int) -> None:
        if req.try_no == try_no and req.retry_try:  # else it ended first (`_end_try`)
            req.retry_try = False
            self.replicas[req.replica].budget.retrying -= 1

    def _timeout(self, t: float, req: Req, try_no: int) -> None:
        if req.done or req.try_no != try_no:
            return
        node = req.node
        assert node is not None
        phase = req.phase
        if phase == RUNNING:
            if req.start + req.head * req.factor <= t:
                return  # its headers came in time
            node.integrate(t)
            node.running -= 1
            node.cur = None
            del node.active[req]
            self._release(req, node, t)  # the gateway cancels it: the emulator lets go
            req.phase = CONNECTING
            self._next(node, t)
        elif phase == QUEUED:
            node.stale += 1
            node.cur = None
            req.phase = CONNECTING
        elif phase == STUCK:
            node.hung.remove(req)
        self._replan(node, t)
        self._try_failed(req, "timeout", t)
