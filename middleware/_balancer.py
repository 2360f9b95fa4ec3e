"""The balancer: node table, strategy, evidence loops and the one upstream session, and the
try-and-retry logic that both the ASGI proxy and the in-app client use."""
# Over 350 lines: the retry loop and the bookkeeping of a try's end (in-flight, results, request
# faults, learning) are one state machine over a try's lifetime; split, each half would need the
# other's locals.

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import aiohttp
from promptlb.shared import ConfigError
from yarl import URL

from ._affinity import Affinity
from ._alarms import Alarms
from ._background import Evidence
from ._config import Config
from ._metrics import Metrics
from ._nodes import Node, NodeTable
from ._prefix import PrefixIndex
from ._refusals import NoNodeAvailable, UnknownModel, UpstreamError
from ._rules import RetryBudget
from ._share import IndexShare
from ._shedding import Admission
from ._strategies import make_strategy
from ._strategy import Strategy
from ._view import NodeView, RouteRequest

if TYPE_CHECKING:
    from ._request import Request

__all__ = ["Balancer", "Try", "Upstream"]

_log = logging.getLogger("promptlb.middleware")

# RFC 9110 7.6.1 hop-by-hop headers, plus those the proxy sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        # The gateway's server answered the client's 100-continue and read the whole body:
        # passed on, aiohttp held that body until the node sent a 100 (a node that never
        # does timed the try out, charged for it).
        "expect",
    }
)
# The client's alone, never a node's business: its cookies (for the app in front) and, unless
# configured, its claims about its own address.
_CLIENT_ONLY = frozenset({"cookie"})
_CLIENT_ADDRESS = frozenset({"x-forwarded-for", "forwarded", "x-real-ip"})
_NAMES_KEPT = 256
_UNSEEN = ""  # not a header name: no name is empty
_OURS = "x-promptlb-"  # promptlb's control headers: for the gateway (a priority token is a secret)
# An engine reading taken this long after a try began, showing nothing running or waiting,
# says the node is not generating the try's answer (`Balancer._engine_idle`).
_IDLE_PROOF_S = 1.0


@dataclass(slots=True)
class Upstream:
    """The response chosen to pass on, and what the caller needs to finish the job."""

    node: Node
    response: aiohttp.ClientResponse
    attempts: int
    started: float  # monotonic, when the successful try began
    deadline: float  # loop time by which the whole answer must be in
    first_byte_at: float | None = None
    failed: bool = False  # the caller saw the stream break
    timed_out: bool = False  # the caller gave up on the node's first byte (a missed ttft)
    queued: int = 0  # the node's effective queue when it was picked, for learning strategies
    request_fault: bool = False  # a second node failed it the same way: the request's fault
    overran: bool = False  # the stream ran past its deadline (it may have asked for that much)
    client_slow: bool = False  # ... while the client was not taking what the node had sent

    def broke(self, exc: BaseException) -> tuple[int, str]:
        """Its answer broke off (``exc`` a ClientError) or ran past the deadline (a
        TimeoutError) after the first byte: the node's failure. The status and the words a
        client is told (not how: the exception may name the node's address)."""
        self.failed = True
        self.overran = isinstance(exc, TimeoutError)
        return (504, "ran past its deadline") if self.overran else (502, "broke")


class _PassThrough(aiohttp.ClientRequest):
    """A try carries the client's headers as they came: aiohttp adds no Accept,
    Accept-Encoding or User-Agent, so the node answers what the client asked, in the bytes the
    client will get. (``skip_auto_headers`` does the same at ~10 us a request: it builds and
    sorts two header maps each time.)"""

    def update_auto_headers(self, skip_auto_headers: Iterable[str] | None) -> None:
        return None


class Balancer:
    """``previous``: the balancer of the config this one replaces (a reload). The node table,
    metrics, random generator and upstream session carry over; so do the strategy (and what it
    learnt), the retry budget and the admission queue, each when its settings are unchanged.
    Nothing of ``previous`` changes until `succeed` is awaited."""

    def __init__(
        self,
        config: Config,
        *,
        rng: random.Random | None = None,
        previous: Balancer | None = None,
    ) -> None:
        self.config = config
        same = previous is not None and _same_strategy(previous.config, config)
        self.strategy: Strategy = previous.strategy if previous and same else _strategy_for(config)
        if config.index_share is not None and self.strategy.prefix_index is None:
            # The strategy named, not the Redis URL: that may carry a password.
            raise ConfigError(
                "index_share", f"strategy {config.strategy!r}", "a cache-aware strategy to share"
            )
        self._share: IndexShare | None = None
        # Told of every try's end, for the other replicas while they share (a no-op else).
        self.index: PrefixIndex | None = self.strategy.prefix_index
        self.alarms = Alarms()  # the tries' timeouts, and the proxy's request watches
        self._budget = RetryBudget(config.retry.budget_percent, config.retry.min_concurrent)
        self._session: aiohttp.ClientSession | None = None
        self._evidence: Evidence | None = None
        self._starting: asyncio.Lock | None = None
        self._successor: Balancer | None = None  # the one a reload put in force over this
        if previous is None:
            self.table = NodeTable(config)
            self.table.on_remove = self._forget_node
            self.metrics = Metrics(lambda: self.table, config.strategy)
            self.rng = rng or random.Random()
            self.admission = Admission(config.shedding, self.table)
        else:
            self.table, self.metrics = previous.table, previous.metrics
            self.rng = rng or previous.rng
            old = previous.config
            if (old.retry.budget_percent, old.retry.min_concurrent) == (
                config.retry.budget_percent,
                config.retry.min_concurrent,
            ):
                self._budget = previous._budget
            self.admission = (
                previous.admission
                if old.shedding == config.shedding
                else Admission(config.shedding, self.table)
            )
        dropped = HOP_BY_HOP | _CLIENT_ONLY
        if not config.forward_authorization:
            dropped |= {"authorization"}
        if not config.forward_client_address:
            dropped |= _CLIENT_ADDRESS
        self._dropped = dropped
        self._names: dict[bytes, str | None] = {}  # see _name_of
        self._assumed_rate = config.outlier.assumed_tokens_per_s
        # Passed with each try, not only set on the session: a reload keeps the session, and
        # a changed connect_timeout went on with the old one.
        self._timeout = aiohttp.ClientTimeout(total=None, connect=config.retry.connect_timeout)

    async def succeed(self, previous: Balancer) -> tuple[list[str], list[str]]:
        """Take over from ``previous``: the node table follows this config (nodes added and
        removed; see `NodeTable.reconfigure`) and, when ``previous`` had started, its session
        passes here and the evidence loops restart under this config, after one round that
        checks the new nodes. ``previous`` keeps its session for the requests still on it.
        Returns the nodes added and removed."""
        previous._successor = self
        if previous._starting is not None:
            self._starting = previous._starting
            async with previous._starting:  # a start under way finishes first
                return await self._take_over(previous)
        return await self._take_over(previous)

    async def _take_over(self, previous: Balancer) -> tuple[list[str], list[str]]:
        newcomers = self.table.newcomers(self.config)
        evidence = None
        if previous._session is not None:
            self._session = previous._session
            evidence = Evidence(
                self.config, self.table, self._session, self.metrics, previous._evidence
            )
            self._evidence = evidence  # told of the nodes that leave below
            # Checked before they join and before any node leaves: the requests that arrive
            # meanwhile still have the old nodes, and the new ones serve from the moment
            # they are members.
            await evidence.check(newcomers)
        # What the strategy learnt of a node that leaves (or whose name is now another server's)
        # goes with it; from now on this balancer's strategy is the one to tell.
        self.table.on_remove = self._forget_node
        changed = self.table.reconfigure(self.config, newcomers)
        self.metrics.use_strategy(self.config.strategy)
        if evidence is not None:
            if previous._evidence is not None:
                await previous._evidence.stop()
                evidence.carry_counts(previous._evidence, changed)
                previous._evidence = None
            await evidence.start(first=False)
            if previous._share is not None:
                await previous._share.stop()
                previous._share = None
            self._start_share()
        return changed

    def _forget_node(self, name: str) -> None:
        """Node ``name`` left the table: what the strategy learnt of it and its metrics go."""
        self.strategy.forget_node(name)
        self.metrics.forget_node(name)
        if self._evidence is not None:
            self._evidence.forget(name)

    @property
    def started(self) -> bool:
        return self._session is not None

    async def start(self) -> None:
        successor = self._successor
        if successor is not None:
            # Superseded by a reload before it ever started, and now a request still on it
            # starts it: it uses the session of the balancer in force, whose loops stop with
            # it. Loops of its own would run under a retired config, and nothing stops them.
            await successor.start()
            self._session = successor._session
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._session is not None:
                return
            session = aiohttp.ClientSession(
                # Bytes pass through as the node sent them: no decompression, no added headers.
                auto_decompress=False,
                request_class=_PassThrough,
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=30),
                timeout=self._timeout,
            )
            try:
                # Built here too: it reads the key and token files, which may fail.
                self._evidence = Evidence(self.config, self.table, session, self.metrics)
                await self._evidence.start()
            except BaseException:
                if self._evidence is not None:
                    await self._evidence.stop()
                    self._evidence = None
                await session.close()
                raise
            # Started (`started`) only now, after the first gossip and health rounds: the
            # requests of a first burst that came while they ran wait on the lock, where
            # they went on at once and found every node not yet healthy (503s).
            self._session = session
            self._start_share()

    def _start_share(self) -> None:
        index = self.strategy.prefix_index
        if self.config.index_share is not None and index is not None:
            self._share = IndexShare(self.config.index_share, index, self.table.nodes, self.metrics)
            self._share.start()

    async def stop(self) -> None:
        if self._starting is None:
            return await self._stop()
        # Under the start's lock: a start under way (a request's, or the in-app client's) ends
        # first, and none begins while this tears down. Stopped beside one, its first rounds
        # finished after this and left loops and a session that nothing would stop.
        async with self._starting:
            await self._stop()

    async def _stop(self) -> None:
        if self._share is not None:
            await self._share.stop()
            self._share = None
        if self._evidence is not None:
            await self._evidence.stop()
            self._evidence = None
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def forward_headers(
        self, node: Node, headers: Iterable[tuple[bytes, bytes]]
    ) -> list[tuple[str, str]]:
        names = self._names
        out = []
        listed: set[str] = set()  # headers the Connection header names are hop-by-hop too
        typed = False
        for raw_name, raw_value in headers:
            name = names.get(raw_name, _UNSEEN)
            if name is _UNSEEN:
                name = self._name_of(raw_name)
            if name is None:
                if raw_name.lower() == b"connection":
                    value = raw_value.decode("latin-1")
                    listed.update(t.strip().lower() for t in value.split(","))
                continue
            try:
                # aiohttp writes a value as UTF-8: read as latin-1, a client's UTF-8 "café"
                # reached the node as "cafÃ©".
                value = raw_value.decode()
            except UnicodeDecodeError:
                value = raw_value.decode("latin-1")  # no UTF-8: its bytes as characters
            out.append((name, value))
            typed = typed or name == "content-type"
        if listed:
            out = [h for h in out if h[0] not in listed]
        if not typed:
            # Else aiohttp labels the body application/octet-stream, which a FastAPI server
            # refuses (422) where it would have read an unlabelled body as JSON. The gateway
            # read it as a JSON object: so it says.
            out.append(("content-type", "application/json"))
        # The node's own key, from the config it is on now: read off the balancer's config, a
        # request still on the old balancer during a reload reached a new node (or a rotated
        # key's) without it, and the client got the node's 401.
        key = node.config.api_key
        if key:
            out = [h for h in out if h[0] != "authorization"]
            out.append(("authorization", "Bearer " + key))
        return out

    def _name_of(self, raw_name: bytes) -> str | None:
        """A client header's name as forwarded, or None when it is not; remembered, up to
        `_NAMES_KEPT` names (clients send a few dozen) and then forgotten all at once."""
        name = raw_name.decode("latin-1").lower()
        forwarded = None if name in self._dropped or name.startswith(_OURS) else name
        names = self._names
        if len(names) >= _NAMES_KEPT:
            names.clear()  # made-up names must not keep the common ones out for good
        names[raw_name] = forwarded
        return forwarded

    def open(
        self,
        request: Request,
        *,
        first_deadline: float | None = None,
        total: float | None = None,
        avoid: set[str] | None = None,
        admit: Callable[[NodeView], bool] | None = None,
        tried: list[str] | None = None,
    ) -> Try:
        """``async with balancer.open(request) as upstream``: route and send, retrying on
        another node (never the same twice) on connect errors, 5xx, 429 and per-try timeouts.
        Yields the response to pass on; retries end here, so nothing is retried once the
        caller has started answering.

        ``first_deadline`` (loop time) bounds the tries, ``total`` (seconds) the whole answer.
        ``avoid`` is shared between attempts racing for one request (a hedge): no two of them
        use the same node. ``admit`` narrows the candidates (load shedding), unless it would
        leave none. ``tried``, when given, is the request's tries so far, appended to: a caller
        that opens again after an answer broke off before its first byte has them count
        against the attempts and the retry budget."""
        return Try(self, request, first_deadline, total, avoid, admit, tried)

    def _let_go(self, node: Node) -> None:
        """A try on ``node`` is over, whatever its outcome: it holds no place there any more,
        and the other replicas, while they share, are told so."""
        node.view.in_flight -= 1
        if self.index is not None:
            self.index.finished(node.name)
        admission = self.admission
        if admission.waiting:
            # Room, whether or not the try answered: a try that failed woke no waiter, and
            # newcomers took the room while the queued ones slept to their next poll.
            admission.wake()

    def _settle(self, upstream: Upstream, route: RouteRequest, aborted: bool, whole: float) -> None:
        """Record how the passed-on try ended, and teach the strategy from a real answer;
        ``whole`` is the seconds the answer was given."""
        node = upstream.node
        if upstream.request_fault:
            self._finish(node, ok=None, started=upstream.started, ttft=None)
        elif upstream.timed_out:
            latency = self._finish(
                node, ok=False, started=upstream.started, ttft=None, outcome="timeout"
            )
            self._given_up(node, route, latency, upstream.first_byte_at is None)
        elif aborted or upstream.client_slow:
            # Given up by the caller, or out of time waiting on the client: not the node's doing.
            self.metrics.of(node).outcome("aborted").inc()
        elif (
            upstream.failed
            and upstream.overran
            and self._needs_longer(node, route, whole, upstream.started)
        ):
            # The stream ran out of time generating what it asked for: its size, not the node.
            # Its first token was one all the same.
            first = upstream.first_byte_at
            answered = route.stream and 200 <= upstream.response.status < 300
            ttft = first - upstream.started if first is not None and answered else None
            self._finish(node, ok=None, started=upstream.started, ttft=ttft)
        else:
            code = upstream.response.status
            # A first token only where the answer streams: a whole answer's first byte comes
            # with its last, and made TTFT (its histogram, its alert) the generation's time.
            # And only from an answer: a 400's or a 503's error body is no token (a stream
            # refused at once read as the fastest first tokens, in the histogram and in the
            # node's TTFT that the strategies read).
            ttft = (
                upstream.first_byte_at - upstream.started
                if upstream.first_byte_at is not None and route.stream and 200 <= code < 300
                else None
            )
            ok = code < 500 and code != 429 and not upstream.failed
            latency = self._finish(
                node,
                ok=ok,
                started=upstream.started,
                ttft=ttft,
                outcome="broken" if upstream.failed else str(code),
            )
            if upstream.failed and upstream.overran:  # cut at its deadline: given up on time
                self._given_up(node, route, latency, upstream.first_byte_at is None)
            # Only real answers teach a learning strategy: a node that answers 4xx at once
            # must not look like the fastest node there is. Nor does a node replaced or removed
            # while the try ran (a reload re-pointed its name, discovery let it go): it would
            # bring back what its removal made the strategy forget, under a name that may now
            # be another server's.
            if ok and code >= 400:
                node.refusals += 1
            if ok and self.table.nodes.get(node.name) is node:
                try:
                    if 200 <= code < 300:
                        self.strategy.observe(route, node.view, latency, ttft, upstream.queued)
                    elif code >= 400:
                        # Any 4xx (429 is no answer, `ok`): a node answering 400 to every
                        # request (a chat template it lacks) was as cold and as idle as one
                        # with a wrong key; a client's bad requests bench an idle node for a
                        # few looks at most (its answers in between end a run).
                        self.strategy.refused(route, node.view)
                except Exception:  # learning must never break a request
                    _log.exception("strategy %s failed to observe", self.config.strategy)

    def _given_up(self, node: Node, route: RouteRequest, latency: float, headless: bool) -> None:
        """A try given up on its time (``headless``: before its first byte) is in the latency
        histogram, and a stream's in the TTFT one, at the time it was given up: at least that
        long. Left out, the tries that break an SLO were the ones its histograms never saw."""
        metrics = self.metrics.of(node)
        metrics.latency.observe(latency)
        if route.stream and headless:
            metrics.ttft.observe(latency)

    def _needs_longer(self, node: Node, route: RouteRequest, given: float, started: float) -> bool:
        """Whether generating the request's ``max_tokens`` at the node's decode rate takes
        longer than the ``given`` seconds: then running out of them is the request's doing.
        Without a ``max_tokens`` nothing says so, and the node answers for the time; nor does
        it when the node's engine is seen idle since the try began at ``started``
        (`_engine_idle`): it was not generating the answer at all (a hung node, whose health
        checks pass, was excused every time a long answer was asked of it, never ejected)."""
        asked = route.max_tokens
        if asked is None:
            return False
        if self._engine_idle(node, started):
            return False
        return asked / (node.decode_rate or self._assumed_rate) > given

    def _engine_idle(self, node: Node, started: float) -> bool:
        """Whether the node's snapshot, not stale, shows its engine with nothing running or
        waiting in a reading taken `_IDLE_PROOF_S` after a try on it began (one taken sooner
        may predate the request's reaching the engine): at the end of a long try, it is not
        working on it at all."""
        snap = node.snapshot
        if snap is None or snap.engine is None or snap.engine.running or snap.engine.waiting:
            return False
        at = node.snapshot_at
        if time.monotonic() - at > self.config.stale_after:  # no load evidence (design.md)
            return False
        # A sidecar keeps its last reading through a late scrape (a busy engine answers
        # /metrics late), and says how old it is.
        return at - snap.engine.age_ms / 1000 > started + _IDLE_PROOF_S

    def _fault(self, suspect: tuple[Node, float, int]) -> None:
        node, started, code = suspect
        self._finish(node, ok=False, started=started, ttft=None, outcome=str(code))

    def _more(self, model: str, tried: set[str]) -> bool:
        candidates = self.table.candidates(model) or ()
        return any(c.name not in tried for c in candidates)

    def _finish(
        self,
        node: Node,
        *,
        ok: bool | None,
        started: float,
        ttft: float | None,
        outcome: str = "request_fault",
    ) -> float:
        """Record a finished try (``ok`` None: the request's fault, not the node's, so it
        counts neither way); returns its latency."""
        now = time.monotonic()
        latency = now - started
        metrics = self.metrics.of(node)
        metrics.outcome(outcome).inc()
        # A first token is one however the try ended: a stream that broke after it, or one cut
        # at a deadline its size explains, had it.
        if ttft is not None:
            metrics.ttft.observe(ttft)
        if ok is None:
            self.table.record_request_fault(node)
            return latency
        self.table.record_result(node, ok, latency if ok else None, ttft, now)
        if ok:
            metrics.latency.observe(latency)
        return latency


class _Expiry:
    """A try's timer: cancels the task, and says it did (so that cancel, and no other, is
    taken for the try's time running out)."""

    __slots__ = ("fired", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.fired = False

    def __call__(self) -> None:
        self.fired = True
        self.task.cancel()


class Try:
    """One request's tries on one model, held open while the caller passes the answer on: a
    plain class, not a generator context manager, since it is on every request. Entering runs
    the retry loop (`Balancer.open` says what it does); leaving settles the try that answered."""

    __slots__ = (
        "_admit",
        "_avoid",
        "_first",
        "_lb",
        "_request",
        "_total",
        "_tried",
        "_upstream",
        "_whole",
    )

    def __init__(
        self,
        lb: Balancer,
        request: Request,
        first_deadline: float | None,
        total: float | None,
        avoid: set[str] | None,
        admit: Callable[[NodeView], bool] | None,
        tried: list[str] | None = None,
    ) -> None:
        self._lb = lb
        self._tried = tried
        self._request = request
        self._first = first_deadline
        self._total = total
        self._avoid = avoid
        self._admit = admit
        self._upstream: Upstream | None = None
        self._whole = 0.0

    async def __aenter__(self) -> Upstream:
        # The retry loop is written out here, not in a coroutine of its own: every resume of a
        # try passes through each coroutine that awaits it.
        lb = self._lb
        if lb._session is None:
            await lb.start()
        session = lb._session
        assert session is not None
        budget = lb._budget
        budget.active += 1
        try:
            cfg = lb.config.retry
            loop = asyncio.get_running_loop()
            task = asyncio.current_task(loop)  # with the loop: no second getpid() on 3.11
            assert task is not None
            # seconds for the answer
            self._whole = whole = self._total if self._total is not None else cfg.total_timeout
            deadline = loop.time() + whole
            first_deadline = self._first
            try_by = deadline if first_deadline is None else min(deadline, first_deadline)
            request = self._request
            route = request.route
            admit = self._admit
            table, metrics = lb.table, lb.metrics
            tried = self._tried
            if tried is None:
                tried = []
            avoid = self._avoid
            if avoid is None:
                avoid = set()
            upstream: Upstream | None = None
            last = "no try made"
            status = 502
            # A 5xx not judged yet: the node's fault, or the request's? A second node failing the
            # request the same way says the request's; any other outcome says the node's.
            suspect: tuple[Node, float, int] | None = None
            try:
                while len(tried) < cfg.attempts:
                    candidates = table.candidates(route.model)
                    if candidates is None:
                        raise UnknownModel(route.model)
                    if avoid:
                        candidates = [c for c in candidates if c.name not in avoid]
                    if tried:
                        if not candidates:
                            break
                        if not budget.allow():
                            metrics.retry_budget_exhausted.inc()
                            break
                    elif not candidates:
                        # The label is the client's model only where a node names it: with
                        # nodes that name none, any string reaches here, one series each.
                        known = table.names_model(route.model)
                        metrics.unavailable.labels(route.model if known else "other").inc()
                        raise NoNodeAvailable(route.model)
                    remaining = try_by - loop.time()
                    if remaining <= 0:
                        status, last = 504, "deadline passed before a try could start"
                        break
                    if admit is not None:
                        candidates = [c for c in candidates if admit(c)] or candidates
                    view = lb.strategy.pick(route, candidates, lb.rng)
                    node = table.nodes[view.name]
                    metrics.node(node.name).picks.inc()
                    if tried:
                        if metrics.member(tried[-1]):
                            metrics.retries.labels(tried[-1]).inc()
                        budget.retrying += 1
                    tried.append(node.name)
                    avoid.add(node.name)
                    queued = view.effective_queue
                    view.in_flight += 1
                    started = time.monotonic()
                    given = min(cfg.per_try_timeout, remaining)
                    # asyncio.timeout's work by hand (a timer that cancels, and only our own
                    # cancel turned into TimeoutError): its object, two coroutine methods and
                    # reschedule cost ~2 us a request, a tenth of the gateway's own time; the
                    # timer is one of the balancer's coarse alarms, not a loop timer (1.5 us).
                    expiry = _Expiry(task)
                    cancelling = task.cancelling()
                    timer = lb.alarms.call_at(loop.time() + given, expiry)
                    try:
                        try:
                            target = request.target
                            response = await session.post(
                                # A query string is passed on as the client encoded it
                                # (`_request._query`), not re-quoted: see there.
                                node.config.url + target
                                if target is request.path
                                else URL(node.config.url + target, encoded=True),
                                data=request.raw,
                                headers=lb.forward_headers(node, request.headers),
                                timeout=lb._timeout,
                            )
                        except asyncio.CancelledError:
                            if not expiry.fired or task.uncancel() > cancelling:
                                raise
                            raise TimeoutError from None
                        finally:
                            timer.cancel()
                        if expiry.fired:  # a cancel swallowed on the way: ours, take it back
                            task.uncancel()
                    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                        lb._let_go(node)
                        # The detail names the node's address: for the log, not the client.
                        _log.debug("try on node %s failed: %r", node.name, exc)
                        if not isinstance(exc, TimeoutError):
                            status, last = 502, "could not reach a node"
                        elif not expiry.fired:
                            # aiohttp's own timeout, the connect's (the only one the session
                            # sets): the node's doing, whatever the request asks (a 504, as
                            # nginx answers a connect timeout).
                            status, last = 504, "timed out connecting to a node"
                        elif not route.stream and lb._needs_longer(node, route, given, started):
                            # A non-streamed answer comes whole: at the node's speed this one
                            # could not have come in time, and would not elsewhere either.
                            status = 504
                            last = (
                                f"max_tokens {route.max_tokens} takes longer than the {given:g}s"
                                " a try is given; stream it, or ask for fewer tokens"
                            )
                            lb._finish(node, ok=None, started=started, ttft=None)
                            break
                        else:
                            status, last = 504, "timed out"
                        latency = lb._finish(
                            node, ok=False, started=started, ttft=None, outcome="error"
                        )
                        if status == 504:
                            lb._given_up(node, route, latency, True)
                        if suspect is not None:
                            # The next try failed otherwise: no second node failed the request
                            # alike, so the 5xx was its node's (else a third node's same 5xx
                            # would have cleared both).
                            lb._fault(suspect)
                            suspect = None
                        continue
                    except BaseException:
                        # Cancelled before the headers (a hedge's loser, a client gone): the
                        # try holds no place on the node any more.
                        lb._let_go(node)
                        raise
                    finally:
                        if len(tried) > 1:
                            budget.retrying -= 1
                    code = response.status
                    if code >= 500 and suspect is not None and suspect[2] == code:
                        # Two nodes failed this request the same way: it is the request (a
                        # poison prompt), not either node. No third try, no failure counted.
                        lb._finish(suspect[0], ok=None, started=suspect[1], ttft=None)
                        suspect = None
                        upstream = Upstream(node, response, len(tried), started, deadline)
                        upstream.request_fault = True
                        break
                    # Retried only when a retry can be made: a final 5xx or 429 let go of and
                    # then no try (budget spent, deadline passed) would answer 502 for it.
                    retryable = (
                        (code >= 500 or code == 429)
                        and len(tried) < cfg.attempts
                        and try_by > loop.time()
                        and lb._more(route.model, avoid)
                    )
                    if retryable and not budget.allow():
                        metrics.retry_budget_exhausted.inc()
                        retryable = False
                    if retryable:
                        response.release()
                        lb._let_go(node)
                        last = f"a node answered {code}"
                        if suspect is not None:
                            # Another answer came between: the held 5xx was its node's (after a
                            # 429, a third node's same 5xx booked both as the request's).
                            lb._fault(suspect)
                            suspect = None
                        if code == 429:
                            lb._finish(node, ok=False, started=started, ttft=None, outcome="429")
                        else:
                            suspect = (node, started, code)
                        continue
                    upstream = Upstream(
                        node, response, len(tried), started, deadline, queued=queued
                    )
                    break
            finally:
                if suspect is not None:  # no second node failed it alike: the node's fault
                    lb._fault(suspect)
            if upstream is None:
                raise UpstreamError(status, f"every try failed; last: {last}", len(tried))
        except BaseException:
            budget.active -= 1
            raise
        self._upstream = upstream
        return upstream

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(exc)

    def close(self, exc: BaseException | None = None) -> None:
        """Settle the try that answered (``exc``: what ended the caller's use of it, if
        anything did); what ``__aexit__`` does, for callers that hold a try open past their own
        block (the dispatcher) and need no coroutine to end it."""
        upstream = self._upstream
        if upstream is None:
            return
        self._upstream = None
        lb = self._lb
        # The caller judged the node's own answer a failure (a final 5xx or 429 with a fallback
        # hop onward, no first byte in time, a broken body: ``failed``, whatever it raised
        # after): the node's outcome. Anything else raised means the caller gave up (client
        # gone, deadline): not the node's fault.
        aborted = exc is not None and not isinstance(exc, UpstreamError) and not upstream.failed
        try:
            if aborted or upstream.failed:
                upstream.response.close()  # the node sees the disconnect and stops working
            else:
                upstream.response.release()
            lb._let_go(upstream.node)
            lb._settle(upstream, self._request.route, aborted, self._whole)
        finally:
            lb._budget.active -= 1


def _strategy_for(config: Config) -> Strategy:
    """The configured strategy, wrapped by ``[affinity]`` when set; errors name the key."""
    try:
        strategy = make_strategy(config.strategy, **config.strategy_options)
    except ConfigError as exc:
        raise ConfigError(f"strategy_options.{exc.key}", exc.value, exc.expected) from None
    affinity = config.affinity
    if affinity is None:
        return strategy
    try:
        return Affinity(strategy, epsilon=affinity.epsilon, vnodes=affinity.vnodes)
    except ConfigError as exc:
        raise ConfigError(f"affinity.{exc.key}", exc.value, exc.expected) from None


def _same_strategy(old: Config, new: Config) -> bool:
    """Whether a reload may keep the strategy object, and what it learnt of the nodes."""
    return (old.strategy, old.strategy_options, old.affinity) == (
        new.strategy,
        new.strategy_options,
        new.affinity,
    )
