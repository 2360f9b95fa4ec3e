"""The scenario's faults on a node, as the emulator plays them: ``crash`` drops everything and
refuses connections, ``hang`` holds new requests at admission, ``slow`` stretches the requests
that come after it, ``recover`` undoes them all; the replicas' health checks then see the change."""

from __future__ import annotations

import math

from ._scenario import SLOW_FACTOR, Fault
from ._simnode import CONNECTING, CRASHED, HUNG, QUEUED, UP, Node, Req
from ._simtries import Tries

__all__ = ["Faults"]


class Faults(Tries):
    def _fault(self, node: Node, fault: Fault, now: float) -> None:
        kind = fault.kind
        if kind == "crash":
            if node.state == CRASHED:
                return
            self._drop_all(node, now)
            node.state = CRASHED
            if self.perfect:
                self._leave_group(node)
            else:
                self._schedule_detection(node, now, up=False)
        elif kind == "hang":
            if node.state != UP:
                return
            node.state = HUNG  # work already admitted still completes, as in the emulator
            if self.perfect:
                self._leave_group(node)
        elif kind == "recover":
            was = node.state
            if was == UP and node.factor == 1.0:
                return
            node.integrate(now)
            node.factor = 1.0
            node.state = UP
            node.cur = None
            memory = node.memory
            if memory is not None:
                # The live runner starts a dead node again (a new process: its RSS idle, a
                # new sidecar boot) and turns a live one's faults off (its leak stops).
                if was == CRASHED:
                    memory.restart()
                else:
                    memory.per_request_mb = 0.0
            if was == HUNG:
                # The hang is lifted: the held requests go on, in the order they came, with
                # their per-try timeouts still running.
                held, node.hung = node.hung, []
                for req in held:
                    req.factor = 1.0
                    self._admit(req, node, now)
            if self.perfect:
                self._leave_group(node)
                self._join_group(node)
                self._replan(node, now)
            elif was == CRASHED:
                self._schedule_detection(node, now, up=True)
        elif kind == "slow":
            node.factor = fault.value or SLOW_FACTOR
            if self.perfect and node.state == UP:
                self._leave_group(node)
                self._join_group(node)
                self._replan(node, now)
        elif kind == "leak" and node.memory is not None:
            # Memory, not time: what the sidecar projects against a memory limit, and the
            # gateway drains for (`_simleak`). Without a limit the sidecar projects against
            # the host's free memory, which a minute's leak does not come near.
            node.memory.per_request_mb = fault.value

    def _drop_all(self, node: Node, now: float) -> None:
        """A crash: streams already answering break (not retried); tries still waiting for
        their headers see a reset and are retried elsewhere, as the proxy does."""
        node.integrate(now)
        last = node.snapshot(now)  # what the replicas keep seeing until the node is back
        broken: list[Req] = []
        reset: list[Req] = []
        for req in node.active:
            if req.start + req.head * req.factor <= now:
                broken.append(req)
            else:
                reset.append(req)
        reset.extend(r for r in node.queue if r.node is node and r.phase == QUEUED and not r.done)
        reset.extend(node.hung)
        node.active.clear()
        for req in broken + reset:
            req.lease = None
        node.lose_cache()
        node.queue.clear()
        node.hung = []
        node.stale = 0
        node.running = 0
        node.cur = last
        node.cur_until = math.inf  # a dead engine's last word stands
        for req in broken:
            if not self.perfect:
                self._record(req.replica, node.idx, ok=False, now=now)
            self._fail(req, "crash", now)
        for req in reset:
            req.phase = CONNECTING
            self._try_failed(req, "crash", now)
