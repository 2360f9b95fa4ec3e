"""``predictive``: the node where this request should finish first, learnt online.

Expected completion on a node = expected queue wait + expected service time:

* **service** = a + b * output + c * input, fitted per node by recursive least squares (with
  forgetting, so a node that slows down is followed within a few dozen requests) on what the
  balancer observes: each successful try's latency less the wait predicted for it. ``output``
  is the request's ``max_tokens``, or the history of its class when it gives none.
* **wait** = the requests ahead of a free slot over the slots, times the node's mean service.
  The queue is `NodeView.effective_queue` (the engine's running + waiting, plus ours since the
  snapshot) plus the trend of the others' queue between the last snapshots; the slots are
  learnt from snapshots (the running count whenever the engine reports a waiting queue).

Nodes within `NEAR_TIE` (20%) of the best expected time are a tie, since the time is read off
a snapshot up to a second old: of them, the one with the fewest of this replica's requests in
flight (fresh, and its own), a draw among equals; a node failing more often than the best is
not in the tie, and one holding more of the prompt than the best, within `HOLDER_TIE` (10%) of
its time, narrows the tie to the nodes holding as much. Past that margin the two best
candidates are sampled in inverse proportion to the fourth powers of their expected times, so
that replicas sharing one stale view do not all pour onto the same node; unless the best holds
more of the prompt in its KV cache than the other, then it is taken. A holder whose engine has
never shown a queue (its slots unknown, so its wait reads nothing) keeps its cache's edge only
while its load is at most twice the least loaded node's plus `HOT_SLACK` (8). A
node with fewer than ``warmup`` observations is cold: it gets a request of no more than the
usual length whenever it has none of ours in flight (a probe: its model is learnt within a few
requests without flooding it). A cold node whose snapshot shows its engine's tokens/s and
running count is not probed but estimated from them: every gateway replica knows its decode
speed from the first snapshot, where answers of its own would take a replica 1/N of the traffic
to gather. While no candidate is warm or estimated, the strategy behaves as ``p2c``.
Above ``sample`` candidates it looks at a random ``sample`` of them, so a pick stays bounded at
1,000 nodes.

**Cache-aware** (``cache_aware``, on by default): the input term counts only the prompt tokens a
node is not expected to hold in its KV cache, per a `_prefix.PrefixIndex` of what this strategy
sent where, so c is learnt as the node's prefill time per uncached token (from each answer's
head: its TTFT less the predicted wait) and a node holding a prompt's prefix wins by the
prefill it saves, weighed against its queue like everything else. A prefix no candidate holds
goes, unless that costs over ``cold_slack`` more than the best, to the node that rendezvous
hashing of its first block names, so independent replicas agree where it starts. With the
index shared (`_share`), the other replicas' records are load too: their tries started less
those ended since a node's snapshot came (`NodeView.others_since_snapshot`) are counted into its
queue; and each replica's answers teach the others' models, so that every
replica learns a node from all the answers, not from its 1/N share of them.
"""
# Over 350 lines: the service model and the strategy that reads it; the prefix index is in
# _prefix.

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence

from promptlb.shared import ConfigError, Snapshot

from ._config_base import whole_number
from ._prefix import INDEX_TOKENS, PrefixIndex, Reading
from ._rendezvous import first_choice
from ._simple import LeastConn
from ._strategy import FORGET_SPAN, Scoring, Strategy, distinct_sample
from ._view import NodeView, RouteRequest

__all__ = ["Predictive", "ServiceModel"]

_OUT_SCALE = 100.0  # features in hundreds of output tokens and thousands of input tokens keep
_IN_SCALE = 1000.0  # the least-squares problem well conditioned
_MAX_CLASSES = 1024
_UNCACHED_KEPT = 4096  # picks awaiting their answers, the oldest let go first
_P_CAP = 1e4  # bounds the covariance: forgetting with little excitation would inflate it
_OUT_SPREAD = 16.0  # an answer teaches a max_tokens at most this many times its class's usual
# A cold node failing this share of its tries is not probed: only answers warm a node, so one
# that fails fast took every probe (each a request's first try) until outlier ejection.
_PROBE_ERRORS = 0.25
# A node that refused this many tries in a row (4xx: no failure, nothing learnt; a wrong API key,
# a model it lacks) sits out picks, twice as many after each further refusal: answering at once
# and never learnt, it was a cold node with nothing in flight, and took every probe (99.8% of
# the traffic of three nodes, all refused, where round robin sent it a third).
_REFUSALS = 3
_SIT_OUT = 8
_MAX_SIT_OUT = 1024
# Expected times this close to the best are a tie, settled by our own requests in flight. In the
# simulator (three or four seeds, 1 and 8 replicas) 0.2 took shared-system-prompt's TTFT p90 at
# one replica from 0.37 s to 0.18 s (least_conn 0.20 s) and at eight from 0.80 s to 0.57 s, and
# lowered latency p99 on every prefix-free scenario; 0.1 and 0.3-0.5 did less, and a
# deterministic tie-break (fewest in flight, then the time) herded eight replicas.
NEAR_TIE = 0.2
# Within the tie, a node holding more of the prompt than the best does is preferred if its time
# is this close. In the simulator (eight seeds, 1 s old snapshots) it took multi-tenant-chat's
# hit rate from 0.57 to 0.66 at one replica and from 0.34 to 0.43 at eight sharing an index
# (TTFT p90 1.97 -> 1.75 s), rag's from 0.32 to 0.36 there (1.68 -> 1.59 s); at one replica
# rag's TTFT p90 went 1.31 -> 1.35 s, and at eight unshared replicas, which know an eighth of
# where prefixes went, multi-tenant-chat's 2.39 -> 2.46 s. Preferring any holder in the tie
# (0.2) cost rag 12% of its TTFT p90 at one replica.
HOLDER_TIE = 0.1
# A node whose engine has never shown a waiting queue has no learnt slots: whatever it runs,
# one more is expected to start at once, so the holder of a hot prefix won every pick (120 long
# requests of 120, none answered yet, in the pitfall's test). Such a holder, best by its cache,
# keeps that edge only while its load is at most twice the least loaded node's plus this many
# (SGLang's router goes to the shortest queue past 32 more and 1.1x); past it, it competes as a
# node without the prefix, and so on for the next best. Checked on the best node, so that a
# pick pays for it only then; the least loaded, not the runner-up, is the measure (two holders
# took 60 each of the 120 and left the third node idle). The committed simulator scenarios (6
# slots, queues shown) never reach it; with 64 slots (queues never shown) it moved
# multi-tenant-chat's and rag's TTFT p90 by about 1% over six seeds: the simulated engine
# serves a full batch as fast as one request, and piling there costs only KV space, where a
# real engine slows down.
HOT_SLACK = 8
# A model that has learnt from this many answers takes a reading as at most `_MAX_JUMP` times
# what it predicts (`ServiceModel.update`).
_SETTLED = 8
_MAX_JUMP = 8.0


class ServiceModel:
    """One node's learnt service time, a + b * out + c * in, by recursive least squares.

    ``forget`` (0 < forget <= 1) discounts old readings: 0.97 gives them a half-life of about
    23 readings (a streamed answer is two: its decode and its head, so about 11 answers).
    The coefficients are clamped at prediction, not in the fit, so that a transient negative
    estimate cannot wedge the filter.
    """

    __slots__ = (
        "count",
        "forget",
        "in_flight_at_refusal",
        "mean_service",
        "others",
        "p",
        "peak",
        "prior",
        "rate",
        "refused",
        "sit_out",
        "slots",
        "snapshot",
        "theta",
        "trend",
    )

    def __init__(self, forget: float = 0.97, prior: float = 100.0) -> None:
        self.forget = forget
        self.prior = prior
        self.theta = [0.0, 0.0, 0.0]
        self.p = _prior(prior)
        self.count = 0
        self.mean_service = 0.0  # EWMA of the observed service time, seconds
        self.slots = 0  # learnt from snapshots: the running count when the engine had a queue
        self.peak = 0  # the most requests seen running: a lower bound while slots is unknown
        # Seconds per hundred output tokens per request, from the engine's tokens/s over its
        # running count (0 until a snapshot shows both): a cold node's decode speed.
        self.rate = 0.0
        self.trend = 0.0  # EWMA of the others' queue change between snapshots
        self.others: int | None = None  # the others' queue at the last snapshot
        self.snapshot: Snapshot | None = None
        self.refused = 0  # tries the node refused since its last answer learnt
        self.sit_out = 0  # picks it sits out yet, once it has refused `_REFUSALS` in a row
        self.in_flight_at_refusal = 0  # our tries on it when it last refused (`sits_out`)

    def service(self, out_tokens: float, in_tokens: float) -> float:
        a, b, c = self.theta
        # Conditionals, not max(): `Predictive._time` writes this out for every candidate of
        # every pick, and the two must stay equal.
        return (
            (a if a > 0.0 else 0.0)
            + (b if b > 0.0 else 0.0) * out_tokens / _OUT_SCALE
            + (c if c > 0.0 else 0.0) * in_tokens / _IN_SCALE
        )

    def wait(self, queue: float, mean_service: float | None = None) -> float:
        """Seconds before a newcomer behind ``queue`` requests gets a slot (FIFO)."""
        # Until a queue has shown the slots, they are taken as one more than the most seen
        # running: unknown capacity is never taken for much room, but a node is let grow into
        # its own. At the most seen, a node that got less early on would look full at its own
        # share and keep getting less (seen live: one of four equal nodes at 4% of the load).
        slots = self.slots or self.peak + 1
        if queue < slots:
            return 0.0
        if mean_service is None:
            mean_service = self.mean_service
        return (queue - slots + 1) * mean_service / slots

    def update(
        self,
        out_tokens: float,
        in_tokens: float,
        service_s: float,
        decode_s: float | None = None,
        *,
        head: bool = True,
    ) -> None:
        """One observed try: ``service_s`` in all, of which ``decode_s`` (when the first token's
        time is known) after the first token. Decoding never waits in a queue, so split in two
        it is a clean reading of b, and only the head carries the error of the guessed wait."""
        if self.count >= _SETTLED:
            # One reading moves a settled model at most so far (both parts scaled alike): one
            # streamed answer that stalled 300 s, after fifty of 2 s, priced its node at minutes
            # for good, and a node no pick goes to sends no answer to correct it (1 pick in
            # 20,000 after; a shared reading spread that to every replica). A node that really
            # slowed down is learnt within some answers all the same.
            bound = _MAX_JUMP * self.service(out_tokens, in_tokens)
            if bound > 0.0 and service_s > bound:
                if decode_s is not None:
                    decode_s *= bound / service_s
                service_s = bound
        if decode_s is not None and out_tokens > 0:
            self._fit(0.0, out_tokens / _OUT_SCALE, 0.0, decode_s)
            if head:
                self._fit(1.0, 0.0, in_tokens / _IN_SCALE, service_s - decode_s)
        else:
            self._fit(1.0, out_tokens / _OUT_SCALE, in_tokens / _IN_SCALE, service_s)
        self.count += 1
        ms = self.mean_service
        self.mean_service = service_s if self.count == 1 else ms + 0.1 * (service_s - ms)

    def _fit(self, x0: float, x1: float, x2: float, y: float) -> None:
        """One recursive least-squares step with forgetting, for y = theta . x."""
        p = self.p
        # P x
        px0 = p[0] * x0 + p[1] * x1 + p[2] * x2
        px1 = p[3] * x0 + p[4] * x1 + p[5] * x2
        px2 = p[6] * x0 + p[7] * x1 + p[8] * x2
        lam = self.forget
        denom = lam + x0 * px0 + x1 * px1 + x2 * px2
        k0, k1, k2 = px0 / denom, px1 / denom, px2 / denom
        theta = self.theta
        err = y - (theta[0] * x0 + theta[1] * x1 + theta[2] * x2)
        theta[0] += k0 * err
        theta[1] += k1 * err
        theta[2] += k2 * err
        # P = (P - k (P x)^T) / lambda; P stays symmetric, so x^T P = (P x)^T. Written out:
        # on every answer, and a loop over nine cells costs three times as much.
        p[0] = (p[0] - k0 * px0) / lam
        p[1] = (p[1] - k0 * px1) / lam
        p[2] = (p[2] - k0 * px2) / lam
        p[3] = (p[3] - k1 * px0) / lam
        p[4] = (p[4] - k1 * px1) / lam
        p[5] = (p[5] - k1 * px2) / lam
        p[6] = (p[6] - k2 * px0) / lam
        p[7] = (p[7] - k2 * px1) / lam
        p[8] = (p[8] - k2 * px2) / lam
        # Symmetric in exact arithmetic only: rounding drifted the pairs apart until P was no
        # longer positive (a negative diagonal by answer 667 of a mixed stream, predictions off
        # by 0.9 s in 1.6), and a negative trace escaped the cap below.
        p[1] = p[3] = (p[1] + p[3]) * 0.5
        p[2] = p[6] = (p[2] + p[6]) * 0.5
        p[5] = p[7] = (p[5] + p[7]) * 0.5
        if p[0] <= 0.0 or p[4] <= 0.0 or p[8] <= 0.0:
            self.p = _prior(self.prior)
            return
        trace = p[0] + p[4] + p[8]
        if trace > _P_CAP:
            scale = _P_CAP / trace
            for i in range(9):
                p[i] *= scale

    def sits_out(self, in_flight: int) -> bool:
        """Whether a node that refused `_REFUSALS` tries in a row or more sits this pick out:
        during its sit-out (`refuse`), and while a try of ours started since its last refusal
        is out on it. Its sit-out over, it is looked at on every pick until its next answer
        or refusal, one try at a time (with refusals coming back 20 picks late, it took 258
        of 20,000 picks, not 32); the tries it had before, answers still streaming, do not
        hold it out."""
        if self.sit_out:
            self.sit_out -= 1
            return True
        return in_flight > self.in_flight_at_refusal

    def refuse(self, in_flight: int) -> None:
        """A refusal more: from the `_REFUSALS`-th in a row, the node sits out the next
        `_SIT_OUT` picks that look at it, twice as many after each further one (its own
        answer ends the run). Restarted by a refusal only: restarted whenever a look did not
        pick it, a node whose key was fixed waited a full sit-out after each such look."""
        self.refused += 1
        self.in_flight_at_refusal = in_flight
        if self.refused >= _REFUSALS:
            self.sit_out = min(_SIT_OUT << min(self.refused - _REFUSALS, 16), _MAX_SIT_OUT)

    def see(self, snapshot: Snapshot, in_flight_at_snapshot: int) -> None:
        """A new snapshot: learn the slots, and the trend of the others' queue."""
        again = snapshot.same_reading(self.snapshot)
        self.snapshot = snapshot
        if again:
            return  # the same engine reading: nothing new to learn from (it would weigh twice)
        engine = snapshot.engine
        if engine is None:
            self.others = None
            return
        # Learnt when a queue shows them; and raised by a reading running more with none: an
        # engine seen queueing early on (vLLM queues arrivals until its next step) set them
        # for good, and its node looked full at a sixtieth of its slots.
        if engine.running > self.slots and (engine.waiting > 0 or self.slots):
            self.slots = engine.running
        if engine.running > self.peak:
            self.peak = engine.running
        tps = engine.tps
        # No token counted in the window says nothing (every request still before its first
        # token, a counter that moves at the end of a request): skipped, not taken as "slow".
        if tps and engine.running > 0:
            reading = _OUT_SCALE * engine.running / tps
            # A tps so small the reading overflows would make the rate inf, then NaN for good.
            if math.isfinite(reading):
                rate = self.rate
                self.rate = reading if rate == 0.0 else rate + 0.3 * (reading - rate)
        # Other gateways' requests only: ours since the snapshot are counted exactly already.
        others = engine.running + engine.waiting - in_flight_at_snapshot
        if self.others is not None:
            self.trend += 0.3 * ((others - self.others) - self.trend)
        self.others = others


def _but(nodes: Sequence[NodeView], sat: list[str] | None) -> Sequence[NodeView]:
    """``nodes`` less those sitting this pick out (`ServiceModel.sits_out`), unless that
    leaves none."""
    if sat is None:
        return nodes
    left = [node for node in nodes if node.name not in sat]
    return left or nodes


def _prior(prior: float) -> list[float]:
    """A row-major 3x3 covariance whose large diagonal says "know nothing yet"."""
    return [prior, 0.0, 0.0, 0.0, prior, 0.0, 0.0, 0.0, prior]


def _two_best(
    looked: Sequence[NodeView], times: dict[str, float]
) -> tuple[float, NodeView, float, NodeView]:
    """The best time and node, and the runner-up's, as the pick's loop finds them."""
    best = second = math.inf
    first_node = second_node = looked[0]
    for node in looked:
        t = times.get(node.name)
        if t is None:
            continue
        if t < best:
            second, second_node = best, first_node
            best, first_node = t, node
        elif t < second:
            second, second_node = t, node
    return best, first_node, second, second_node


def _real(key: str, value: object, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(key, value, f"a number in ({low}, {high}]")
    if not low < value <= high:
        raise ConfigError(key, value, f"a number in ({low}, {high}]")
    return float(value)


class Predictive:
    """The least expected completion time (see the module's docstring)."""

    name = "predictive"

    def __init__(
        self,
        inner: Strategy,
        *,
        # Answers before a node's own fit is used. One is enough: the fit starts from a loose
        # prior and is corrected by every answer, while each cold pick is blind to the cache
        # and to load (8 replicas each warming 8 nodes: 3 answers cost multi-tenant-chat 20%
        # of its TTFT p90 in the simulator; seed-3am at 50 replicas lost 5% of p99 with 1).
        warmup: int = 1,
        sample: int = 16,
        forget: float = 0.97,
        default_output_tokens: int = 256,
        cache_aware: bool = True,
        index_capacity: int = 8192,
        index_ttl: int = 1_000_000,
        cold_slack: float = 0.5,
    ) -> None:
        self.warmup = whole_number("warmup", warmup, 1)
        self.sample = whole_number("sample", sample, 2)
        self.forget = _real("forget", forget, 0.5, 1.0)
        self.default_output_tokens = whole_number("default_output_tokens", default_output_tokens, 1)
        self.inner = inner  # picks until the nodes are learnt (p2c, as the registry builds it)
        self._spread = LeastConn(sample=self.sample)
        self.scoring: Scoring | None = inner.scoring
        self._models: dict[str, ServiceModel] = {}
        self._old_models: dict[str, ServiceModel] = {}
        self._picks_left = FORGET_SPAN
        # (model, prompt class) -> EWMA of the max_tokens its requests asked for
        self._history: dict[tuple[str, str], float] = {}
        self._mean_out = 0.0  # EWMA of the expected output of every request routed
        if not isinstance(cache_aware, bool):
            raise ConfigError("cache_aware", cache_aware, "true or false")
        zero = not isinstance(cold_slack, bool) and cold_slack == 0
        self.cold_slack = 0.0 if zero else _real("cold_slack", cold_slack, 0.0, 10.0)
        # Aged in picks, not seconds: a strategy has no clock of its own (the simulator runs
        # it on virtual time), and an idle gateway's cache entries are not getting older.
        self.index: PrefixIndex | None = None
        # Checked with the index off too: a bad value turning up only once it is switched on.
        capacity = whole_number("index_capacity", index_capacity, 16)
        ttl = float(whole_number("index_ttl", index_ttl, 1))
        if cache_aware:
            self.index = PrefixIndex(capacity=capacity, ttl=ttl)
            self.index.on_reading = self._learn_reading
        self._tick = 0
        # The uncached prompt tokens of each pick, until its answer teaches the model: by the id
        # of the route (one object per request, the same at pick and at observe) and the node,
        # since a hedged request is picked twice and answered by either; with the route's
        # prompt length, so that a failed try's entry is not read by a later request that
        # CPython gave the freed id (holding the route itself would keep its block hashes, a
        # long context's tens of KB, alive per entry). Bounded: the oldest go first (answers
        # that never came), each in O(1).
        self._uncached: OrderedDict[tuple[int, str], tuple[int, float]] = OrderedDict()

    @property
    def prefix_index(self) -> PrefixIndex | None:
        return self.index

    def _model(self, name: str) -> ServiceModel:
        model = self._models.get(name)
        if model is None:
            model = self._old_models.pop(name, None) or ServiceModel(self.forget)
            self._models[name] = model
        return model

    def expected_output(self, request: RouteRequest) -> float:
        if request.max_tokens is not None and request.max_tokens > 0:
            return float(request.max_tokens)
        return self._history.get(
            (request.model, request.prompt_class), float(self.default_output_tokens)
        )

    def expected_time(
        self, request: RouteRequest, node: NodeView, out: float, uncached: float | None = None
    ) -> float | None:
        """Seconds until ``request`` would finish on ``node`` with ``uncached`` of its prompt
        tokens to prefill (all of them by default); ``None`` while the node is cold."""
        return self._time(request, node, self._model(node.name), out, uncached)

    def _time(
        self,
        request: RouteRequest,
        node: NodeView,
        model: ServiceModel,
        out: float,
        uncached: float | None,
    ) -> float | None:
        """`expected_time` with the node's model at hand: the pick reads the model too.

        Runs for every candidate of every pick, so the non-cold path writes out
        `NodeView.effective_queue`, `ServiceModel.wait` and `ServiceModel.service` (a third of
        the cache-aware pick's loop at 64 nodes went to those calls); a test holds it equal
        to them."""
        snap = node.snapshot
        if snap is not None and snap is not model.snapshot:
            model.see(snap, node.in_flight_at_snapshot)
        cold = model.count < self.warmup
        if cold and model.rate == 0.0:
            return None
        queue: float = node.in_flight
        if snap is None:
            # Unknown load is never idle: assume every slot we know of is taken.
            queue = max(queue, model.slots or model.peak + 1)
        else:
            engine = snap.engine
            if engine is not None:
                others = engine.running + engine.waiting - node.in_flight_at_snapshot
                others += node.others_since_snapshot
                if others > 0:
                    queue += others
            if model.trend > 0 and (self.index is None or not self.index.sharing):
                # Half a snapshot period of the others' growth. Replicas that share tell theirs
                # instead (`NodeView.others_since_snapshot`, in the effective queue): counted,
                # where the trend only guesses (8 replicas, 1 s old snapshots,
                # multi-tenant-chat: TTFT p90 2.12 s -> 1.90 s in the simulator, eight seeds,
                # counting their starts; with their ends too, reset as each snapshot comes, 1.57
                # -> 1.50 s, at 50 replicas 2.74 -> 2.23 s; in the queue each answer is learnt
                # against, 2.02 -> 1.71 s there).
                queue += 0.5 * model.trend
        if cold:
            # Learnt from no answer yet, but the snapshots tell its decode speed: every replica
            # knows it from the first snapshot, not after probes of its own. The head (first
            # token) is unknown until answers come, and left out.
            rate = model.rate / _OUT_SCALE
            total = model.wait(queue, rate * self._mean_out) + rate * out
        else:
            prefill = request.input_tokens if uncached is None else uncached
            slots = model.slots or model.peak + 1
            total = 0.0 if queue < slots else (queue - slots + 1) * model.mean_service / slots
            a, b, c = model.theta
            total += (
                (a if a > 0.0 else 0.0)
                + (b if b > 0.0 else 0.0) * out / _OUT_SCALE
                + (c if c > 0.0 else 0.0) * prefill / _IN_SCALE
            )
        if node.error_rate > 0:
            total /= max(0.05, 1.0 - node.error_rate)  # a failed try costs a retry
        ramp = node.ramp
        return total if ramp >= 1.0 else total / (ramp if ramp > 0.1 else 0.1)

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        index = self.index
        if index is None or not request.blocks:
            chosen = self._pick(request, candidates, rng, None)
            if index is not None and index.sharing:
                index.record(chosen, (), self._tick)  # the other replicas count it as load
            return chosen
        self._tick += 1
        held: dict[str, int] = {}
        chosen = self._pick(request, candidates, rng, held)
        depth = held.get(chosen.name)
        if depth is None:  # not among those looked at (a cold start's pick): asked before the
            # record below, which would make every prompt look cached where it was just sent
            depth = index.matches(request.blocks, (chosen,), self._tick).get(chosen.name, 0)
        index.record(chosen, request.blocks, self._tick)
        self._remember(request, chosen, depth)
        return chosen

    def placed(self, request: RouteRequest, node: NodeView) -> None:
        """A wrapper placed ``request`` on ``node`` itself (``[affinity]``'s ring): recorded
        as a pick of ours, with what the node was expected to hold then, so that its answer
        teaches the prefill rate from the uncached part (it was taught the whole prompt,
        most of it cached on a session's node, and learnt prefill as nearly free)."""
        index = self.index
        if index is None:
            return
        if not request.blocks:
            index.placed(node, request.blocks)  # for the others' count of its load
            return
        # A pick of ours, on the clock too: recorded at the last pick's tick, the ring's
        # placements shared one stamp, and trimming kept the first sent, not the last.
        self._tick += 1
        depth = index.matches(request.blocks, (node,), self._tick).get(node.name, 0)
        self._remember(request, node, depth)
        index.record(node, request.blocks, self._tick)

    def _remember(self, request: RouteRequest, node: NodeView, depth: int) -> None:
        uncached = self._uncached
        if len(uncached) >= _UNCACHED_KEPT:
            uncached.popitem(last=False)
        uncached[id(request), node.name] = (request.input_tokens, self._prefill(request, depth))

    def _taught(self, request: RouteRequest, name: str) -> float:
        """The prompt tokens ``request``'s answer from node ``name`` teaches as prefill: what
        the node lacked at the pick, or the whole prompt when that is not known."""
        entry = self._uncached.pop((id(request), name), None)
        if entry is not None and entry[0] == request.input_tokens:
            return entry[1]
        return float(request.input_tokens)

    @staticmethod
    def _prefill(request: RouteRequest, depth: int) -> float:
        """The prompt tokens a node that holds ``depth`` coarse blocks of it has to prefill."""
        left = request.input_tokens - depth * INDEX_TOKENS
        return left if left > 0 else 0.0

    def _pick(
        self,
        request: RouteRequest,
        candidates: Sequence[NodeView],
        rng: random.Random,
        held: dict[str, int] | None,
    ) -> NodeView:
        """``held``, when given, is filled with the index's matches among the nodes looked at."""
        n = len(candidates)
        self._picks_left -= 1
        if self._picks_left <= 0:
            if self.index is not None:  # the nodes of two spans: a node gone for one is gone
                self.index.keep_only(set(self._models) | set(self._old_models))
            self._old_models, self._models = self._models, {}
            self._picks_left = FORGET_SPAN
        if n <= 1:
            # Counted too: a model served by one node at a time (a one-pod deployment rolled
            # over and over) kept every past pod's model and index entries for good.
            if n:
                self._model(candidates[0].name)  # alive: kept through the next forgetting
            return self.inner.pick(request, candidates, rng)  # raises NoNodeAvailable on none
        # Without replacement at any size: a best node drawn twice was its own runner-up.
        looked = candidates if n <= self.sample else distinct_sample(candidates, self.sample, rng)
        out = self.expected_output(request)
        mean_out = self._mean_out
        # Probes are requests of no more than the usual length: a long one sent blind to a slow
        # node would be the run's worst latency.
        self._mean_out = out if mean_out == 0.0 else mean_out + 0.02 * (out - mean_out)
        if held is not None and self.index is not None:
            held.update(self.index.matches(request.blocks, looked, self._tick))
        best = second = math.inf
        first_node = second_node = looked[0]
        probes: list[NodeView] = []
        answered = busy_unknown = False
        times: dict[str, float] = {}
        models = self._models
        sat: list[str] | None = None  # the names sitting this pick out (`ServiceModel.sits_out`)
        for node in looked:
            name = node.name
            model = models.get(name) or self._model(name)
            if model.refused >= _REFUSALS and model.sits_out(node.in_flight):
                sat = [name] if sat is None else [*sat, name]  # (rare: a list per pick else)
                continue
            uncached = None if held is None else self._prefill(request, held.get(name, 0))
            t = self._time(request, node, model, out, uncached)
            if model.count:
                answered = True
            elif node.in_flight:
                busy_unknown = True  # requests out, none answered: its estimate is a guess yet
            if t is None:
                # A cold node is learnt one request at a time: it may get this one if it has
                # none of ours in flight, else it sits out until its first answers are in.
                if (
                    node.in_flight == 0
                    and out <= self._mean_out
                    and node.error_rate < _PROBE_ERRORS
                ):
                    probes.append(node)
                continue
            times[node.name] = t
            if t < best:
                second, second_node = best, first_node
                best, first_node = t, node
            elif t < second:
                second, second_node = t, node
        if probes:
            return probes[rng.randrange(len(probes))] if len(probes) > 1 else probes[0]
        credit = held  # the holders whose cache counts for this pick (`HOT_SLACK`)
        bound = -1.0  # the load past which a holder of unknown slots loses its edge, once needed
        while credit and second != math.inf and credit.get(first_node.name):
            model = models[first_node.name]
            load = first_node.effective_queue if model.slots == 0 else 0
            if load <= HOT_SLACK:
                break
            if bound < 0.0:
                bound = 2 * self._least_other_load(looked, times, first_node) + HOT_SLACK
            if load <= bound:
                break
            if credit is held:
                credit = dict(held)
            credit[first_node.name] = 0
            t = self._time(request, first_node, model, out, float(request.input_tokens))
            times[first_node.name] = math.inf if t is None else t
            best, first_node, second, second_node = _two_best(looked, times)
        if busy_unknown and not answered:
            # Requests are out and no node has answered any (a burst on a fresh gateway):
            # neither a snapshot's estimate nor p2c's resource score, which the hosts' CPU can
            # outweigh, may take everything meanwhile (382 of 500 streams went to one node).
            # Spread by queue until the first answers are in; from then on the models decide
            # (spreading for longer cost the simulator's 8 replicas, each learning from an
            # eighth of the traffic, nearly twice the p99 on hetero-8).
            return self._spread.pick(request, _but(looked, sat), rng)
        if best == math.inf:  # no node warm yet and none busy: a true cold start
            return self.inner.pick(request, _but(candidates, sat), rng)
        if held is not None and not held and self.cold_slack:
            # A prefix nobody holds: where rendezvous hashing of its first block over every
            # candidate says (not the sample looked at, which differs by replica), unless that
            # node is much worse, so that replicas that do not share an index agree.
            agreed = first_choice(request.blocks[0], candidates)
            learnt = models.get(agreed.name)
            # One that refuses is timed only where its sit-out let the pick look at it: timed
            # here, unsampled, it never sat out (325 of 20,000 picks, all refused, at 32 nodes).
            if agreed.name not in times and (learnt is None or learnt.refused < _REFUSALS):
                t = self.expected_time(request, agreed, out)
                times[agreed.name] = math.inf if t is None else t  # 0.0 is a time: not None
            t = times.get(agreed.name)
            if t is not None and t <= best * (1.0 + self.cold_slack):
                return agreed
        if second == math.inf:
            return first_node
        if credit and credit.get(first_node.name, 0) > credit.get(second_node.name, 0):
            # The best holds more of the prompt than the runner-up: its edge is the prefill it
            # saves, not a near tie on one stale view, and sharing it out would also spread the
            # prefix to a node that must prefill it again (in the simulator, 1 replica on
            # multi-tenant-chat: TTFT p90 1.83 s -> 1.51 s over six seeds, hit rate 0.34 -> 0.51).
            return first_node
        if second <= best * (1.0 + NEAR_TIE):
            shared = self.index is not None and self.index.sharing
            return self._least_busy(looked, times, first_node, credit, rng, shared)
        # The better of the two in proportion to the fourth power of the other's time: a near tie
        # is shared (1 s vs 1.2 s is 2:1), so that replicas on one stale view do not herd, but a
        # node twice as slow gets one request in 17, not one in 3. The linear share sent seed-3am's
        # slow heavy node 78 requests to the bound's 17 in the simulator, at twice its p99.
        # As a ratio, 0..1: fourth powers of the times themselves could overflow or underflow.
        ratio = best / second if second > 0.0 else 1.0
        r2 = ratio * ratio
        if rng.random() * (1.0 + r2 * r2) < 1.0:
            return first_node
        return second_node

    @staticmethod
    def _least_other_load(
        looked: Sequence[NodeView], times: dict[str, float], holder: NodeView
    ) -> float:
        """The least load of the other nodes timed whose load is known: one without a snapshot
        reads our own requests alone (often none: the bound at 8 spread a prefix between two
        equally loaded holders), a cold one cannot take the request, and the holder is no
        measure of itself. With none such, no bound: the others' unknown load already counts
        as busy in their times."""
        least = math.inf
        for node in looked:
            if node is not holder and node.snapshot is not None and node.name in times:
                load = node.effective_queue
                if load < least:
                    least = load
        return least

    @staticmethod
    def _least_busy(
        looked: Sequence[NodeView],
        times: dict[str, float],
        best_node: NodeView,
        held: dict[str, int] | None,
        rng: random.Random,
        shared: bool = False,
    ) -> NodeView:
        """A near tie: of the nodes within `NEAR_TIE` of the best node's time that fail no more
        often and hold as much of the prompt as it does, or as the deepest holder within
        `HOLDER_TIE` of it, the one with the fewest of our requests in flight, a draw among
        equals. Our own count is fresh and ours alone, where the snapshots behind the times are
        a second old and the same for every replica: replicas that each go to their own least
        busy node do not herd, as they would on the snapshot's best, and the time is not read
        closer than it is known.

        Replicas that share (``shared``) know every replica's requests to within the exchange's
        period instead: the fewest in the effective queue then. In the simulator (eight seeds,
        8 sharing replicas) that took shared-system-prompt's TTFT p90 from 0.66 to 0.51 s and
        multi-tenant-chat's from 1.39 to 1.28 s (50 replicas: 1.71 -> 1.58 s, hit rate 0.45 ->
        0.43); replicas alone, on their snapshots, herd on it (shared-system-prompt 0.82 ->
        0.88 s)."""
        best = times[best_node.name]
        bound = best * (1.0 + NEAR_TIE)
        errors = best_node.error_rate
        # A higher error rate is not stale-snapshot noise but our own failed tries, fading: such
        # a node has its rate back under the floor before it shares a tie (else one that hung
        # gets a fifth of the traffic two half-lives on, as an equal).
        tied = [
            node
            for node in looked
            if times.get(node.name, math.inf) <= bound and node.error_rate <= errors
        ]
        depth = 0
        if held:
            # A holder all but as fast as the best: its edge is not only this prompt's prefill
            # but the next turn's, which finds its whole history where it went; spread to a
            # node holding less, a conversation's cache is split and prefilled again. Below
            # the depth, a near time is a prefill more: not a tie.
            depth = held.get(best_node.name, 0)
            close = best * (1.0 + HOLDER_TIE)
            for node in tied:
                if times[node.name] <= close:
                    holds = held.get(node.name, 0)
                    if holds > depth:  # not max(): a call per tied node, on every pick
                        depth = holds
        fewest = math.inf
        pool: list[NodeView] = []
        for node in tied:
            if depth and held and held.get(node.name, 0) < depth:
                continue
            busy = node.effective_queue if shared else node.in_flight
            if busy < fewest:
                fewest, pool = busy, [node]
            elif busy == fewest:
                pool.append(node)
        return pool[rng.randrange(len(pool))] if len(pool) > 1 else pool[0]

    def observe(
        self,
        request: RouteRequest,
        node: NodeView,
        latency_s: float,
        ttft_s: float | None,
        queue_at_pick: int,
    ) -> None:
        """A successful try took ``latency_s``; ``queue_at_pick`` was the node's queue then."""
        model = self._model(node.name)
        # An answer of its own ends a run of refusals: not another replica's (`_learn_reading`),
        # since a key may be wrong at this replica alone (a stale Secret mid-rotation).
        model.refused = model.sit_out = 0
        prefill = self._taught(request, node.name)
        waited = model.wait(queue_at_pick) if model.count else 0.0
        # The wait is a guess: never let it take more than most of what was measured.
        service = max(latency_s - waited, 0.2 * latency_s)
        out = self.expected_output(request)
        # Only what requests asked for: a length implied by an answer's latency, through a b
        # that was itself fitted to such lengths, ran away (non-streamed chats without
        # max_tokens: 2e14 tokens within a thousand picks, then b at 0 and no way back). With
        # no size known, `out` stays one constant and b takes the mean length up.
        if request.max_tokens is not None and request.max_tokens > 0:
            # An upper bound, not the length: one 32,768 among answers of a few hundred (a
            # client's "as much as it takes") drove b to nothing for a thousand answers and
            # the class's length to 500,000. Taught at most `_OUT_SPREAD` times the usual.
            usual = self._history.get(
                (request.model, request.prompt_class), float(self.default_output_tokens)
            )  # (a class's first answer against the default length)
            if out > _OUT_SPREAD * usual:
                out = _OUT_SPREAD * usual
            self._learn_class(request, out)
        decode = None
        if ttft_s is not None and 0.0 < ttft_s < latency_s and request.stream:
            decode = latency_s - ttft_s
        # A head read behind a queue carries the error of the guessed wait, which the fit would
        # take for prefill (or a fixed cost): with a decode reading to learn from, skip it.
        clean = waited == 0.0
        service = max(service, decode or 0.0)
        model.update(out, prefill, service, decode, head=clean)
        if self.index is not None:
            self.index.tell((node.name, out, prefill, service, decode, clean))

    def refused(self, request: RouteRequest, node: NodeView) -> None:
        self._model(node.name).refuse(node.in_flight)

    def forget_node(self, name: str) -> None:
        self._models.pop(name, None)
        self._old_models.pop(name, None)
        if self.index is not None:
            self.index.forget(name)

    def _learn_reading(self, reading: Reading) -> None:
        """Another replica's answer, read as its own model read it: 8 replicas on
        multi-tenant-chat, each learning from an eighth of the answers, had a TTFT p90 of
        1.86 s and a hit rate of 0.43 in the simulator (one replica: 1.15 s, 0.66); learning
        from all of them, 1.57 s and 0.54 (eight seeds)."""
        name, out, prefill, service, decode, clean = reading
        self._model(name).update(out, prefill, service, decode, head=clean)

    def _learn_class(self, request: RouteRequest, tokens: float) -> None:
        # By model too: an embeddings model's requests said nothing of a chat model's.
        key = (request.model, request.prompt_class)
        history = self._history
        old = history.pop(key, None)  # back in last: the least recently taught goes first
        if old is None and len(history) >= _MAX_CLASSES:
            # Classes can come from a header: they must not pile up, nor may junk ones keep
            # out for good a class or a model first seen after them.
            del history[next(iter(history))]
        history[key] = tokens if old is None else old + 0.05 * (tokens - old)

    def model_of(self, name: str) -> ServiceModel | None:
        """The learnt model of node ``name``, for the status page and tests."""
        return self._models.get(name) or self._old_models.get(name)
