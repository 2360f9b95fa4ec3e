"""Load shedding by priority: who may raise a priority, when a pool is saturated, and the bounded
queue where standard requests wait for room."""

from __future__ import annotations

import asyncio
import bisect
import hmac
import ipaddress
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from ._config_degrade import SheddingConfig
from ._nodes import NodeTable
from ._refusals import Shed
from ._view import NodeView, Priority

__all__ = ["Admission", "QueueTimeout"]

_PRIORITIES: dict[bytes, Priority] = {
    b"critical": "critical",
    b"standard": "standard",
    b"sheddable": "sheddable",
}
_RANK = {"sheddable": 0, "standard": 1, "critical": 2}
_POLL = 0.05  # a waiter also rechecks this often: snapshots change saturation without a wake


class QueueTimeout(Exception):
    """A standard request waited ``queue_timeout`` and the pool is still saturated, or found
    the queue full: it takes the chain's next hop, else 429."""


class Admission:
    def __init__(self, config: SheddingConfig, table: NodeTable) -> None:
        self.config = config
        self.enabled = config.enabled
        self._table = table
        self._networks = [ipaddress.ip_network(n, strict=False) for n in config.trusted_networks]
        token = config.priority_token
        self._token = token.encode() if token else None
        # (arrival, model, future), oldest first, over every model: a wake goes to the oldest
        # whose model has room, and the arrival keeps a woken waiter's place.
        self._waiters: deque[tuple[int, str, asyncio.Future[None]]] = deque()
        self._arrivals = 0
        self.waiting = 0
        self._waiting_for: dict[str, int] = {}  # the waiting, by model (woken ones until they run)

    def priority(self, header: bytes | None, token: bytes | None, client: Any) -> Priority:
        """The request's priority: as asked when it is a lowering (or the default); raised
        above ``standard`` only for a trusted client."""
        asked = _PRIORITIES.get(header.strip().lower(), "standard") if header else "standard"
        if _RANK[asked] <= _RANK["standard"] or self._trusted(token, client):
            return asked
        return "standard"

    def _trusted(self, token: bytes | None, client: Any) -> bool:
        if (
            self._token is not None
            and token is not None
            and hmac.compare_digest(token, self._token)
        ):
            return True
        if not self._networks or not client:
            return False
        try:
            address = ipaddress.ip_address(client[0])
        except ValueError:
            return False
        if any(address in net for net in self._networks):
            return True
        # A dual-stack listener reports an IPv4 client as ::ffff:a.b.c.d, which no IPv4 network
        # contains: its trusted critical requests were lowered to standard. Both forms count.
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        return mapped is not None and any(mapped in net for net in self._networks)

    def over(self, view: NodeView) -> bool:
        """True when the node is past one of the configured thresholds."""
        cfg = self.config
        if cfg.max_in_flight is not None and view.in_flight >= cfg.max_in_flight:
            return True
        snap = view.snapshot
        if snap is None or snap.engine is None:
            return False  # unknown load is not saturation: the in-flight cap still applies
        engine = snap.engine
        if cfg.max_kv is not None and engine.kv_cache is not None and engine.kv_cache >= cfg.max_kv:
            return True
        if cfg.max_waiting is not None:
            ours_since = max(0, view.in_flight - view.in_flight_at_snapshot)
            return engine.waiting + ours_since > cfg.max_waiting
        return False

    def open(self, view: NodeView) -> bool:
        return not self.over(view)

    def saturated(self, candidates: Iterable[NodeView]) -> bool:
        saw = False
        for view in candidates:
            saw = True
            if not self.over(view):
                return False
        return saw

    async def admit(self, model: str, priority: Priority) -> None:
        """Return when ``model`` may be tried; raise `Shed` (answer 429 now) or `QueueTimeout`
        (degrade, or answer 429)."""
        if not self.enabled or priority == "critical":
            return
        cfg = self.config
        if not self._is_saturated(model):
            if priority == "sheddable" and self._waiting_for.get(model):
                # The room is the queued ones' (a wake is on its way): a sheddable newcomer
                # took it, and a standard request queued before it timed out into a 429.
                raise Shed(model, cfg.retry_after)
            return
        if priority == "sheddable":
            raise Shed(model, cfg.retry_after)
        if self.waiting >= cfg.queue_size:
            # No room to wait: what a wait's end would do, at once (a chain's lighter model
            # serves it where a 429 used to, just when the primary is most overwhelmed).
            raise QueueTimeout(model)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.queue_timeout
        self.waiting += 1
        waiting_for = self._waiting_for
        waiting_for[model] = waiting_for.get(model, 0) + 1
        future: asyncio.Future[None] | None = None
        admitted = False
        self._arrivals += 1
        arrival = self._arrivals
        try:
            while self._is_saturated(model):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise QueueTimeout(model)
                if future is None or future.done():
                    woken = future is not None  # (done: only a wake sets it)
                    future = loop.create_future()
                    if woken:
                        # Woken, and the room taken before it ran: back in its place by its
                        # arrival, not at the back behind every later waiter (nor at the very
                        # front, ahead of an older one woken with it).
                        bisect.insort(self._waiters, (arrival, model, future), key=_arrival)
                    else:
                        self._waiters.append((arrival, model, future))
                    if len(self._waiters) > 4 * cfg.queue_size + 16:
                        self._waiters = deque(w for w in self._waiters if not w[2].done())
                await asyncio.wait((future,), timeout=min(remaining, _POLL))
            admitted = True
        finally:
            self.waiting -= 1
            if waiting_for[model] > 1:
                waiting_for[model] -= 1
            else:
                del waiting_for[model]
            if future is not None:
                if not future.done():
                    future.cancel()
                elif not admitted and not future.cancelled():
                    # Woken, then gone (its client left) before it ran: the room it was
                    # given goes to the next waiter, not to the next 50 ms poll.
                    self.wake()

    def wake(self) -> None:
        """A request finished: the oldest waiter whose model has room now goes in. The oldest
        of all, waiting on another model still saturated, was woken instead, found no room and
        queued again at the back, while the one that could go waited for its poll."""
        waiters = self._waiters
        while waiters and waiters[0][2].done():
            waiters.popleft()
        full: set[str] = set()
        for i, (_, model, future) in enumerate(waiters):
            if future.done() or model in full:
                continue
            if self._is_saturated(model):
                full.add(model)
                continue
            del waiters[i]
            future.set_result(None)
            return

    def _is_saturated(self, model: str) -> bool:
        candidates: Sequence[NodeView] | None = self._table.candidates(model)
        return bool(candidates) and self.saturated(candidates or ())


def _arrival(waiter: tuple[int, str, asyncio.Future[None]]) -> int:
    return waiter[0]
