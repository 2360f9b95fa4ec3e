"""The way to an answer: a fresh cached answer, admission, then the hops of the model's fallback
chain (lighter models, the cache), each with its deadlines and optional hedging.

Everything here happens before the first byte reaches the client: once an `Answer` is handed
over, the caller streams it and nothing is retried or degraded any more.
"""
# Over 350 lines: the chain's walk, the hedge's race and the settling of every attempt that is
# not passed on share one request's deadlines and tries; split, each would take the others'
# state as arguments.

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from types import TracebackType

import aiohttp

from ._answer import Answer
from ._balancer import Balancer, Upstream
from ._cache import CacheEntry, ResponseCache, cache_key, open_cache, sampled
from ._config import Config
from ._config_degrade import CACHE_HOP, CacheConfig, FallbackConfig
from ._refusals import Exhausted, NoNodeAvailable, Refusal, Shed, UnknownModel, UpstreamError
from ._request import Request, caller_names
from ._shedding import QueueTimeout
from ._sse import replayable, wants_usage

__all__ = ["Dispatcher"]

_HopError = (NoNodeAvailable, UnknownModel, UpstreamError)
_log = logging.getLogger("promptlb.middleware")


class Dispatcher:
    """``previous``: the dispatcher of the config this one replaces (a reload); its cache (and
    the cache writes under way) carries over when ``[cache]`` is unchanged. Otherwise the old
    cache is left to ``previous``'s requests and is `retired`: closed once they are over."""

    def __init__(self, balancer: Balancer, *, previous: Dispatcher | None = None) -> None:
        self._lb = balancer
        self.balancer = balancer
        config = balancer.config
        self.config = config
        self._chains: dict[str, FallbackConfig] = {c.model: c for c in config.fallback}
        # The headers that tell callers apart, for the cache's keys and the batcher's.
        self.caller_names = caller_names(config.forward_authorization, config.caller_headers)
        cache_cfg = config.cache
        self.cache_config = cache_cfg
        # The most of an answer kept for the cache, for the proxy's and the in-app client's
        # recorders alike.
        self.entry_limit = cache_cfg.max_entry_bytes if cache_cfg is not None else 0
        self.cache: ResponseCache | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self.retired: list[ResponseCache] = []  # replaced, not closed yet
        self._closing: set[asyncio.Task[None]] = set()
        if previous is not None:
            self.retired, self._closing = previous.retired, previous._closing
            if _store(previous.cache_config) == _store(cache_cfg):
                # Only how answers are served changed (serve_fresh, ttl, sampling, families):
                # the stored answers stay. A new store lost them all, a memory backend's most
                # of all, which is what an outage falls back on.
                self.cache, self._writes = previous.cache, previous._writes
            elif previous.cache is not None:
                self._retire(previous.cache, previous._writes, previous.config)
        if cache_cfg is not None and self.cache is None:
            errors = balancer.metrics.cache_errors
            self.cache = open_cache(
                cache_cfg.backend,
                max_bytes=cache_cfg.max_bytes,
                ttl=cache_cfg.stale_ttl,
                prefix=cache_cfg.key_prefix,
                timeout=cache_cfg.timeout,
                on_error=lambda op: errors.labels(op).inc(),
            )
        self._families: Mapping[str, str] = cache_cfg.families if cache_cfg else {}
        # Whether anything serves a stored answer degraded: an outage, or a chain's cache hop
        # (any chain's: another model's chain may ask this one's key).
        self._stands_in = cache_cfg is not None and (
            cache_cfg.on_outage or any(CACHE_HOP in c.then for c in config.fallback)
        )
        # A refusal's Retry-After when it carries none: the nodes' state may change by the next
        # round of health checks.
        self.retry_after = str(max(1, round(config.health.interval))).encode()

    def _retire(
        self, cache: ResponseCache, writes: set[asyncio.Task[None]], config: Config
    ) -> None:
        """``cache`` was replaced by a reload: closed (a memory one's answers freed, a Redis
        pool's connections) once the requests that began on it are over, at most the longest
        answer its config allows from now, or at shutdown if that comes first. It was kept
        until shutdown: each reload that touched [cache] held another 64 MB."""
        self.retired.append(cache)
        whole = config.retry.total_timeout
        # Each hop of a chain is bounded by the chain's total (else the retry config's).
        longest = max([whole, *((1 + len(c.then)) * (c.total or whole) for c in config.fallback)])

        async def close() -> None:
            await asyncio.sleep(longest)
            if writes:
                await asyncio.gather(*writes, return_exceptions=True)
            await cache.close()
            self.retired.remove(cache)

        try:
            task = asyncio.get_running_loop().create_task(close())
        except RuntimeError:
            return  # built outside a loop (not a live reload): closed at shutdown
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def stop(self) -> None:
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        await self._lb.stop()
        for cache in (*self.retired, *([self.cache] if self.cache is not None else [])):
            await cache.close()
        self.retired.clear()

    def store(self, key: str, entry: CacheEntry) -> None:
        """Write in the background: the client already has its answer."""
        cache = self.cache
        if cache is None:
            return
        task = asyncio.ensure_future(cache.put(key, entry))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def key(self, request: Request, model: str) -> str | None:
        """The cache key of ``request``'s answer from ``model`` (None: not to be cached)."""
        if self.cache_config is None:
            return None
        # Nodes see the caller's own key (api-key and the like always; Authorization when
        # forwarded): one caller's answer is not another's (a key the node refuses must not
        # read a cached answer), nor is a caller without one.
        caller = request.caller(self.caller_names)
        family = self._families.get(model, model)
        return cache_key(request.target, request.body, family, caller)

    def answer(self, request: Request) -> _Answering:
        """``async with dispatcher.answer(request) as answer``: find the answer (raising a
        `Refusal` when there is none) and hold its upstream open while the caller passes it on.
        A plain class rather than a generator context manager: it is on every request."""
        return _Answering(self, request)

    def _finding(self, request: Request) -> Coroutine[None, None, Answer]:
        """The coroutine that finds the request's answer, for `answer` to await directly:
        the plain one when there is nothing to degrade to, without `_find` around it (one
        coroutine fewer that every resume of the try passes through)."""
        chain = self._chains.get(request.route.model)
        if chain is not None and request.no_fallback and chain.allow_opt_out:
            chain = None
        if chain is None and self.cache is None:
            if not self._lb.admission.enabled:  # nothing to wait for either: the attempt itself
                return self._attempt(request, None, None, set(), False)
            return self._plain(request)
        return self._find(request, chain)

    async def _plain(self, request: Request) -> Answer:
        """Nothing to degrade to: admitted, then one attempt, without the chain's per-request
        state."""
        route = request.route
        try:
            await self._lb.admission.admit(route.model, route.priority)
        except QueueTimeout:
            raise Shed(route.model, self.config.shedding.retry_after) from None
        return await self._attempt(request, None, None, set(), False)

    async def _find(self, request: Request, chain: FallbackConfig | None) -> Answer:
        route = request.route
        path = request.path
        hops: tuple[str, ...] = (request.model, *chain.then) if chain else (request.model,)
        # The chain as configured, whether or not this request opted out of it: its lighter
        # models' answers are never the primary's fresh one (the opt-out let them pass as one).
        configured = self._chains.get(request.model)
        lighter = frozenset(configured.then) if configured is not None else frozenset()
        cache, cfg, metrics = self.cache, self.cache_config, self._lb.metrics
        keys: dict[str, str | None] = {}

        def usable(entry: CacheEntry | None) -> CacheEntry | None:
            # A client that streams needs an answer we can replay as a stream.
            if entry is not None and route.stream and not replayable(path, entry):
                return None
            return entry

        def key_of(model: str) -> str | None:
            if model not in keys:
                keys[model] = self.key(request, model)
            return keys[model]

        # A sampled request's twin answer stands in for it only when asked (fresh) or degraded.
        is_sampled = cfg is not None and sampled(path, request.body, cfg.default_temperature)
        if cache is not None and cfg is not None and cfg.serve_fresh:
            key = key_of(request.model) if cfg.cache_sampled or not is_sampled else None
            if key is not None:
                entry = usable(await cache.get(key))
                # A family shares answers, but one of the chain's lighter models (stored under
                # the family's key when it stood in) never poses as the primary's fresh answer.
                if entry is not None and entry.model != request.model and entry.model in lighter:
                    entry = None
                # A stream kept without its usage is no fresh answer to a client that may bill
                # by it, whole or streamed with include_usage (`resp.usage` was None on such
                # hits only): the node answers, and its answer, with usage, takes the entry's
                # place. Stale, in an outage, it is served.
                if (
                    entry is not None
                    and not entry.usage
                    and (not route.stream or wants_usage(request.body))
                ):
                    entry = None
                if entry is not None and entry.fresh(time.time(), cfg.ttl):
                    metrics.cache.labels("fresh_hit").inc()
                    return Answer(entry.model, entry=entry)
                metrics.cache.labels("miss").inc()
        limits = self.config.requests
        asked = route.max_tokens  # by either field (the request's own model was checked so)

        def fits(model: str) -> bool:
            """Whether ``model``'s context holds the answer asked."""
            return asked is None or asked <= limits.token_limit(model)

        first = 0
        try:
            await self._lb.admission.admit(route.model, route.priority)
        except QueueTimeout:
            if len(hops) == 1:
                raise Shed(route.model, self.config.shedding.retry_after) from None
            first = 1  # waited long enough for the primary: degrade (counted below)
        failures: list[str] = []
        attempts = 0
        last: Exception | None = None
        # Stored when some path may serve it (fresh with cache_sampled, degraded with
        # degraded_sampled); served stale only by degraded_sampled's say. One flag for both let
        # cache_sampled alone serve hour-old sampled answers in an outage.
        store_ok = cfg is not None and (
            not is_sampled
            or (cfg.degraded_sampled and self._stands_in)
            or (cfg.serve_fresh and cfg.cache_sampled)
        )
        stale_ok = cfg is not None and (cfg.degraded_sampled or not is_sampled)
        # A client that opted out of degraded answers (where the chain lets it) gets the error,
        # not a stale answer: the opt-out dropped the lighter models only, and an outage still
        # served it a day-old answer marked degraded. A fresh hit above is no degraded answer.
        opted_out = request.no_fallback and (configured is None or configured.allow_opt_out)
        outage_cache = (
            cache is not None and cfg is not None and cfg.on_outage and stale_ok and not opted_out
        )

        def following(i: int) -> str | None:
            """The hop tried after hop ``i``: the next cache hop that will be asked, or model
            hop that fits."""
            return next(
                (h for h in hops[i + 1 :] if (stale_ok if h == CACHE_HOP else fits(h))), None
            )

        if first == 1 and (then := following(0)) is not None:
            metrics.fallbacks.labels(route.model, then).inc()
        # The last model hop that can take the request is the final one: cache hops after it
        # ask the cache for its refusal and pass it on when there is none, as [cache] alone
        # does (a chain ending in "cache" turned a node's 429, and its Retry-After, into the
        # gateway's 503).
        last_model = max(
            i for i, hop in enumerate(hops) if i == 0 or (hop != CACHE_HOP and fits(hop))
        )

        for i in range(first, len(hops)):
            hop = hops[i]
            if i and hop == CACHE_HOP:  # (the request's own model is a model, named so or not)
                stored = (
                    await self._stand_in(hops[:i], key_of, usable, attempts) if stale_ok else None
                )
                if stored is not None:
                    return stored
                failures.append("cache: no answer")
                # (A cache hop not asked was passed over: the hop before counted the next.)
                if stale_ok and (then := following(i)) is not None:
                    metrics.fallbacks.labels(route.model, then).inc()
                continue
            if i and not fits(hop):
                # A lighter model whose context is shorter than the answer asked: its node's
                # 400 ("max context 1000") told the client its request was bad, where the
                # primary was only down (no retry, and the chain's cache never asked).
                failures.append(f"{hop}: max_tokens {asked} is past its context")
                continue
            final = i == last_model
            then = None if final else following(i)
            nxt = None if then == CACHE_HOP else then
            try:
                answer = await self._try_model(request.for_model(hop), chain, not final, nxt)
            except _HopError as exc:
                if isinstance(exc, UnknownModel) and chain is None:
                    raise
                last = exc
                attempts += exc.attempts or 0
                failures.append(f"{hop}: {exc}")
                if (then := following(i)) is not None:
                    metrics.fallbacks.labels(route.model, then).inc()
                continue
            answer.attempts += attempts
            if answer.model != hop:  # the hedge to the next hop won: a fallback all the same
                metrics.fallbacks.labels(route.model, answer.model).inc()
            up = answer.upstream
            trailing = CACHE_HOP in hops[i + 1 :] and stale_ok  # the chain's cache hops after it
            outage = outage_cache and CACHE_HOP not in hops[1:]
            if final and (trailing or outage) and up is not None:
                status = up.response.status
                if status >= 500 or status == 429:
                    # The last hop's own refusal: a stored answer stands in for it, else it is
                    # passed on as it is, as without [cache] (its error body, its Retry-After).
                    if trailing:  # the chain's cache hop, asked: counted as a failure's is
                        metrics.fallbacks.labels(route.model, CACHE_HOP).inc()
                    try:
                        stored = await self._stand_in(
                            hops[: i + 1], key_of, usable, answer.attempts
                        )
                    except BaseException as exc:
                        # The client left while the cache was asked: the answer is never
                        # handed on, so nothing else settles its try (its node stayed
                        # counted busy, its connection held).
                        if answer.held is not None:
                            answer.held.close(exc)
                        raise
                    if stored is not None:
                        if answer.held is not None:
                            answer.held.close(None)  # settled by its status: a node failure
                        return stored
            if answer.model != route.model:
                answer.degraded = "fallback"
            # Stored only if some hop may ever serve it: with both cache_sampled and
            # degraded_sampled off, a sampled answer would only take a deterministic one's room.
            if store_ok and answer.upstream is not None and answer.upstream.response.status == 200:
                key = key_of(answer.model)
                # In one family with the primary, a fallback's answer would replace the
                # primary's own under their shared key, and is never served fresh: kept out.
                if answer.model == request.model or key != key_of(request.model):
                    answer.store_key = key
            return answer
        if outage_cache and CACHE_HOP not in hops[1:]:
            stored = await self._stand_in(hops, key_of, usable, attempts)
            if stored is not None:
                return stored
        if chain is None and last is not None:
            raise last
        if first == 1 and attempts == 0:
            # Shed from the primary's queue and no later hop got as far as a node (the cache
            # had nothing, a lighter model had no node): the 429 a chain without them gives,
            # with its Retry-After, not a 503 as if every node had failed.
            raise Shed(route.model, self.config.shedding.retry_after)
        raise Exhausted(route.model, failures, attempts)

    async def _stand_in(
        self,
        models: Iterable[str],
        key_of: Callable[[str], str | None],
        usable: Callable[[CacheEntry | None], CacheEntry | None],
        attempts: int,
    ) -> Answer | None:
        """A stored answer standing in for ``models``' (the cache hop, an outage), marked
        degraded, from the most preferred model that has one this client can take (a
        streaming client, one that replays as a stream): counted as a hit only then, where an
        entry it could not take was counted a hit and ended the search."""
        cache, metrics = self.cache, self._lb.metrics
        if cache is None:
            return None
        for n, model in enumerate(models):
            if n and model == CACHE_HOP:  # the chain's cache hop, not the request's model
                continue
            key = key_of(model)
            if key is None:
                continue
            entry = usable(await cache.get(key))
            if entry is not None:
                metrics.cache.labels("stale_hit").inc()
                return Answer(entry.model, entry=entry, degraded="cache", attempts=attempts)
        metrics.cache.labels("miss").inc()
        return None

    async def _try_model(
        self, request: Request, chain: FallbackConfig | None, onward: bool, nxt: str | None
    ) -> Answer:
        """``request`` at its model, hedged after ``chain.hedge_after`` to another of its nodes,
        else to the next hop ``nxt``. Should both fail, `_find` still tries ``nxt`` as the
        next hop: the hedge had only what was left of the first deadline, and a final hop's
        own refusal is passed on only when it is tried as the final hop."""
        loop = asyncio.get_running_loop()
        ttft = chain.ttft if chain is not None else None
        first_deadline = loop.time() + ttft if ttft is not None else None
        total = chain.total if chain is not None else None
        avoid: set[str] = set()
        hedge_after = chain.hedge_after if chain is not None else None

        def attempt(req: Request) -> asyncio.Task[Answer]:
            return asyncio.ensure_future(self._attempt(req, first_deadline, total, avoid, onward))

        if hedge_after is None:
            return await self._attempt(request, first_deadline, total, avoid, onward)
        tasks = [attempt(request)]
        winner: asyncio.Task[Answer] | None = None
        try:
            done, _ = await asyncio.wait(tasks, timeout=hedge_after)
            if not done:
                candidates = self._lb.table.candidates(request.model) or ()
                if any(c.name not in avoid for c in candidates):
                    tasks.append(attempt(request))
                elif nxt is not None:
                    tasks.append(attempt(request.for_model(nxt)))
                if len(tasks) > 1:
                    self._lb.metrics.hedges.labels("sent").inc()
            winner = await _first_success(tasks, self._lb)
            return winner.result()
        finally:
            try:
                await _settle([t for t in tasks if t is not winner])
            except BaseException:
                # Cancelled while the losers unwound (the client left): the winner's answer is
                # never handed over, so nothing else would settle its try (its node would
                # stay counted busy, its connection held).
                if winner is not None:
                    winner.add_done_callback(_release)
                raise

    async def _attempt(
        self,
        request: Request,
        first_deadline: float | None,
        total: float | None,
        avoid: set[str],
        onward: bool,
    ) -> Answer:
        """One attempt at ``request.model``: tries (with retries) until a node's first chunk is
        in. With somewhere ``onward`` to go, a final 5xx or 429 is a failure, not an answer."""
        lb = self._lb
        critical = request.route.priority == "critical"
        admit = lb.admission.open if lb.admission.enabled and not critical else None
        tried: list[str] = []
        while True:
            # Entered here and left by `answer` once the caller has passed the answer on.
            held = lb.open(
                request,
                first_deadline=first_deadline,
                total=total,
                avoid=avoid,
                admit=admit,
                tried=tried,
            )
            up = await held.__aenter__()
            try:
                status = up.response.status
                if onward and (status >= 500 or status == 429):
                    raise UpstreamError(status, f"a node answered {status}", up.attempts)
                by = up.deadline if first_deadline is None else min(up.deadline, first_deadline)
                content = up.response.content
                try:
                    # A small answer is often in with its headers: then no timer is needed.
                    first = content.read_nowait()
                    if not first and not content.at_eof():
                        async with asyncio.timeout_at(by):
                            first = await content.readany()
                except TimeoutError:
                    up.timed_out = True
                    raise UpstreamError(504, "no first byte in time", up.attempts) from None
                except (aiohttp.ClientError, OSError, ValueError) as exc:
                    # A node that breaks off before its first byte (ClientPayloadError, a
                    # server disconnect: a stream's headers go out before its prefill) is that
                    # try's failure, not a 500 of ours.
                    up.failed = True
                    # The detail may name the node's address: for the log, not the client.
                    _log.debug("answer of node %s broke: %r", up.node.name, exc)
                    raise UpstreamError(502, "the answer broke off", up.attempts) from None
                up.first_byte_at = time.monotonic()
                return Answer(
                    request.model, upstream=up, first=first, attempts=up.attempts, held=held
                )
            except BaseException as exc:
                held.close(exc)
                if not (isinstance(exc, UpstreamError) and up.failed):
                    raise
                if not self._retry(request.model, up, avoid):
                    raise
            # Nothing has reached the client: tried again elsewhere, as a reset before the
            # headers is, within the same attempts, retry budget and deadline.
            total = up.deadline - asyncio.get_running_loop().time()

    def _retry(self, model: str, up: Upstream, avoid: set[str]) -> bool:
        """Whether an answer that broke off before its first byte may be tried again: the
        checks the balancer makes before a retry, so that a refusal says why it failed."""
        lb = self._lb
        if up.request_fault or up.attempts >= lb.config.retry.attempts:
            return False  # (a request two nodes failed alike gets no third try)
        if not lb._more(model, avoid):
            return False
        if up.deadline <= asyncio.get_running_loop().time():
            return False
        if not lb._budget.allow():
            lb.metrics.retry_budget_exhausted.inc()
            return False
        return True


async def _first_success(tasks: list[asyncio.Task[Answer]], lb: Balancer) -> asyncio.Task[Answer]:
    """The first attempt to answer, in start order on a tie. A node's own 5xx or 429 (what a
    final hop passes on rather than fail) wins only once no other attempt is left: a hedge
    0.1 s from its 200 was cancelled for the first try's quick 503, which without the hedge
    would have been retried on that very node."""
    pending = set(tasks)
    error: BaseException | None = None
    refused: list[asyncio.Task[Answer]] = []
    tried = 0  # node tries of the attempts that failed: the answer's attempts count them all
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:  # in start order: on a tie the first attempt wins
            if task not in done:
                continue
            exc = task.exception()
            if exc is not None:
                error = exc
                tried += getattr(exc, "attempts", None) or 0
                continue
            if _refused(task.result()):
                refused.append(task)
                tried += task.result().attempts  # its tries, whichever answer is passed on
                continue
            if len(tasks) > 1:  # one answered before the hedge was due: no race to win
                won = "won_first" if task is tasks[0] else "won_hedge"
                lb.metrics.hedges.labels(won).inc()
            task.result().attempts += tried
            _charge(refused)
            return task
    if refused:
        task, *others = refused
        task.result().attempts = tried
        _charge(others)
        return task
    assert error is not None
    if isinstance(error, Refusal) and error.attempts is not None:
        error.attempts = tried
    raise error


def _refused(answer: Answer) -> bool:
    up = answer.upstream
    return up is not None and (up.response.status >= 500 or up.response.status == 429)


def _charge(refused: list[asyncio.Task[Answer]]) -> None:
    """Settle the tries of refusals that another answer beat: the node's 5xx or 429 all the
    same (a cancel, as the other losers get, would count it as the caller's leaving)."""
    for task in refused:
        answer = task.result()
        up, held = answer.upstream, answer.held
        if held is not None and up is not None:
            code = up.response.status
            held.close(UpstreamError(code, f"a node answered {code}", answer.attempts))


async def _settle(losers: list[asyncio.Task[Answer]]) -> None:
    """Cancel the losers (their node sees the disconnect) and wait for them; one that got a
    response in the same instant as the winner has its try settled as it ends, even when this
    wait is itself cancelled."""
    for task in losers:
        task.cancel()
        task.add_done_callback(_release)
    await asyncio.gather(*losers, return_exceptions=True)


def _release(task: asyncio.Task[Answer]) -> None:
    """An attempt whose answer will not be passed on: settle its try, if it found one."""
    if task.cancelled() or task.exception() is not None:
        return
    held = task.result().held
    if held is not None:
        held.close(asyncio.CancelledError())


class _Answering:
    __slots__ = ("_dispatcher", "_found", "_request")

    def __init__(self, dispatcher: Dispatcher, request: Request) -> None:
        self._dispatcher = dispatcher
        self._request = request
        self._found: Answer | None = None

    async def __aenter__(self) -> Answer:
        try:
            found = await self._dispatcher._finding(self._request)
        except Shed:
            self._dispatcher._lb.metrics.shed.labels(self._request.route.priority).inc()
            raise
        self._found = found
        return found

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        found = self._found
        if found is not None and found.held is not None:
            found.held.close(exc)


def _store(config: CacheConfig | None) -> tuple[object, ...] | None:
    """What the cache's store is built from (`open_cache`'s arguments its backend reads): a
    reload that changes none of it keeps it. A memory store went, with every answer an outage
    would fall back on, at a change of the Redis-only timeout or key prefix."""
    if config is None:
        return None
    if config.backend == "memory":
        return (config.backend, config.max_bytes, config.stale_ttl)
    return (config.backend, config.stale_ttl, config.key_prefix, config.timeout)
