"""The perfect dispatcher, the reference every strategy is measured against: one dispatcher
with exact, instant knowledge of every queue, joining the shortest expected delay. Greedy, one
arrival at a time: a reference, not a lower bound on p99 (predictive's came out at 0.97-0.99x
of it on three committed scenarios, the oracle's at 0.97x on multi-tenant-chat). Each node keeps a
forecast of when its slots free up; alike nodes share a heap, so a pick costs a few heap reads.

The oracle is the same dispatcher that also knows every node's KV cache: the node where the
request should finish first, counting the prefill of the prompt tokens that node truly lacks
now (queue wait + prefill of the uncached + decode). It scans every node (the cache makes alike
nodes differ), which is cheap at the prefix scenarios' sizes."""

from __future__ import annotations

import heapq
import math

from promptlb.shared import BLOCK_TOKENS

from ._scenario import Arrival
from ._simbase import SimState
from ._simnode import QUEUED, Group, Node, Req

__all__ = ["Perfect"]


class Perfect(SimState):
    def _perfect_pick(self, arrival: Arrival, now: float, tried: list[int]) -> Node | None:
        """Join the shortest expected delay with exact state: the node where this request
        would finish first, given every request already placed and this one's service time."""
        best = math.inf
        chosen: Node | None = None
        nodes = self.nodes
        m = arrival.max_tokens
        p = arrival.prompt_tokens
        if tried:  # a retry (rare): a plain scan that can leave nodes out
            for group in self.group_list:
                extra = group.a + group.b * m + group.c * p
                for idx in group.members:
                    if idx in tried:
                        continue
                    free = nodes[idx].free[0]
                    done = (free if free > now else now) + extra
                    if done < best:
                        best, chosen = done, nodes[idx]
            return chosen
        for group in self.group_list:
            heap = group.heap
            while heap:
                top = heap[0]
                if nodes[top[2]].version == top[1]:
                    break
                heapq.heappop(heap)
            else:
                continue
            free = top[0]
            done = (free if free > now else now) + group.a + group.b * m + group.c * p
            if done < best:
                best = done
                chosen = nodes[top[2]]
        return chosen

    def _uncached(self, req: Req, node: Node) -> int:
        """The prompt tokens ``node`` would prefill for ``req``: as far as the perfect
        dispatchers can know before its slot, what is cached there now."""
        prompted = req.prompted
        kv = node.kv
        if prompted is None or kv is None or not self.perfect:
            return req.arrival.prompt_tokens
        return max(0, prompted.tokens - kv.cached_prefix(prompted.blocks) * BLOCK_TOKENS)

    def _oracle_pick(self, req: Req, now: float, tried: list[int]) -> Node | None:
        """The least expected completion with exact queues and exact caches; equals drawn at
        random, as the live oracle does (the first of them, every new prefix went to the
        lowest-numbered idle node and thrashed its cache: a weaker reference than the live one)."""
        best = math.inf
        chosen: list[Node] = []
        out = req.arrival.max_tokens
        for node in self.nodes:
            if node.group is None or node.idx in tried:  # down, or tried already
                continue
            free = node.free[0]
            service = node.ttft + self._uncached(req, node) * node.inv_prefill
            done = (free if free > now else now) + node.factor * (service + out * node.inv_tps)
            if done < best - 1e-9:
                best, chosen = done, [node]
            elif done <= best + 1e-9:
                chosen.append(node)
        if len(chosen) > 1:
            return chosen[self.oracle_rng.randrange(len(chosen))]
        return chosen[0] if chosen else None

    def _join_group(self, node: Node) -> None:
        spec = node.spec
        key = (spec.ttft_ms, spec.tokens_per_s, spec.prefill_tokens_per_s, node.factor)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(spec, node.factor)
            self.group_list.append(group)
        group.members.add(node.idx)
        node.group = group
        self._reindex(node)

    def _leave_group(self, node: Node) -> None:
        if node.group is not None:
            node.group.members.discard(node.idx)
            node.group = None
        node.version += 1  # its heap entries are stale now

    def _reindex(self, node: Node) -> None:
        group = node.group
        if group is None:
            return
        node.version += 1
        heap = group.heap
        heapq.heappush(heap, (node.free[0], node.version, node.idx))
        if len(heap) > 4 * len(group.members) + 64:
            # Stale entries pile up below the top; rebuilding keeps the heap near its members.
            nodes = self.nodes
            group.heap = [(nodes[i].free[0], nodes[i].version, i) for i in group.members]
            heapq.heapify(group.heap)

    def _replan(self, node: Node, now: float) -> None:
        """Recompute when each slot frees up from the node's exact state (after a fault or a
        try that ended early): the forecast `_send` keeps is exact only while nothing does."""
        if not self.perfect:
            return
        free = sorted(r.finish for r in node.active)
        free.extend([now] * (node.slots - len(free)))
        heapq.heapify(free)
        for req in node.queue:
            if req.node is node and req.phase == QUEUED and not req.done:
                t0 = heapq.heappop(free)
                heapq.heappush(free, (t0 if t0 > now else now) + req.base * req.factor)
        node.free = free
        self._reindex(node)
