"""The middleware's Prometheus metrics, in a registry of its own (two middlewares in one
process do not collide).

The four series every request touches (picks, tries by outcome, latency, time to first byte)
are plain numbers turned into Prometheus families at scrape time: prometheus-client's
``Counter.inc`` takes a lock and checks the labels on every call, a tenth of the hop's own cost.
The rest, touched on rarer events, are prometheus-client's own. (The hot four have no
``_created`` series, which nothing in the dashboards, alerts or adapter reads.)"""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ._nodes import Node, NodeTable

__all__ = ["Metrics", "NodeMetrics", "Spread", "Tally"]

# LLM answers: milliseconds (a cached or tiny answer) to minutes (a long generation behind a
# queue). Doubling from 1 s keeps P99 readable where SLOs sit; the last bound is 10 minutes.
# 5 s and 60 s are bounds because the alerts' SLOs sit there: between 4 and 8 a quantile is
# interpolated, and a P99 of answers all under 4.1 s read 6 s against the 5 s SLO.
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 5, 8, 15, 30, 60, 120, 300, 600
)  # fmt: skip


class _Live(Collector):
    """Read at scrape time from the node table: nothing to keep in step per request."""

    def __init__(self, table: Callable[[], NodeTable | None]) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        table = self._table()
        if table is None:
            return
        in_flight = GaugeMetricFamily(
            "promptlb_in_flight_requests", "Requests open on a node.", labels=["node"]
        )
        ready = GaugeMetricFamily(
            "promptlb_node_ready", "1 when a node is ready (its state).", labels=["node"]
        )
        # Apart from ready: a model's last node, ejected or drained, still takes its requests
        # (0 ready read as "no node" to the alerts while it served everything).
        serving = GaugeMetricFamily(
            "promptlb_node_serving",
            "1 when a node takes requests: ready, or its model's last node.",
            labels=["node"],
        )
        leaking = GaugeMetricFamily(
            "promptlb_node_leaking",
            "1 while a node is drained: its sidecar projects its model server out of memory.",
            labels=["node"],
        )
        ramp = GaugeMetricFamily(
            "promptlb_node_ramp_ratio", "Slow-start share, 0..1.", labels=["node"]
        )
        for name, node in table.nodes.items():
            in_flight.add_metric([name], node.view.in_flight)
            state = table.state_of(node)
            ready.add_metric([name], 1.0 if state == "ready" else 0.0)
            serving.add_metric([name], 1.0 if table.serving(node) else 0.0)
            leaking.add_metric([name], 1.0 if state == "leaking" else 0.0)
            ramp.add_metric([name], node.view.ramp)
        yield in_flight
        yield ready
        yield serving
        yield leaking
        yield ramp


class Tally:
    """A counter's value, kept without a lock: the middleware counts from one event loop."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Spread:
    """A histogram's buckets (non-cumulative; the last one past every bound) and sum."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(_LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, Prometheus' "le".
        self.counts[bisect_left(_LATENCY_BUCKETS, value)] += 1
        self.sum += value


# As prometheus-client spells a bound ("1.0", "0.005"): the same series as its own histograms.
_BOUNDS = [str(float(b)) for b in _LATENCY_BUCKETS] + ["+Inf"]


class _PerNode(Collector):
    """The hot series, as Prometheus families at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        # Copied first: a scrape from another thread must not see the dicts change under it.
        requests = CounterMetricFamily(
            "promptlb_requests", "Tries sent to a node, by outcome.", labels=["node", "outcome"]
        )
        for (node, outcome), tally in list(m.outcomes.items()):
            requests.add_metric([node, outcome], tally.value)
        yield requests
        picks = CounterMetricFamily(
            "promptlb_picks", "Strategy picks.", labels=["strategy", "node"]
        )
        for (strategy, node), tally in list(m.picks.items()):
            picks.add_metric([strategy, node], tally.value)
        yield picks
        for name, doc, spreads in (
            ("promptlb_latency_seconds", "Time to the end of the answer.", m.latency),
            (
                "promptlb_ttft_seconds",
                "Time to a streamed answer's first byte (its first token); a try given up on its"
                " time before it, at that time.",
                m.ttft,
            ),
        ):
            family = HistogramMetricFamily(name, doc, labels=["node"])
            for node, spread in list(spreads.items()):
                total, buckets = 0, []
                for bound, count in zip(_BOUNDS, list(spread.counts), strict=True):
                    total += count
                    buckets.append((bound, float(total)))
                family.add_metric([node], buckets, spread.sum)
            yield family


class NodeMetrics:
    """One node's hot series, looked up once per try."""

    __slots__ = ("_metrics", "_name", "latency", "picks", "ttft")

    def __init__(self, metrics: Metrics | None, name: str, strategy: str) -> None:
        """``metrics`` None: series of a node that left, counted nowhere."""
        self._metrics = metrics
        self._name = name
        if metrics is None:
            self.picks, self.latency, self.ttft = Tally(), Spread(), Spread()
            return
        self.picks = metrics.picks.setdefault((strategy, name), Tally())
        self.latency = metrics.latency.setdefault(name, Spread())
        self.ttft = metrics.ttft.setdefault(name, Spread())

    def outcome(self, outcome: str) -> Tally:
        if self._metrics is None:
            return Tally()
        key = (self._name, outcome)
        found = self._metrics.outcomes.get(key)
        if found is None:
            found = self._metrics.outcomes[key] = Tally()
        return found


class Metrics:
    def __init__(self, table: Callable[[], NodeTable | None], strategy: str = "") -> None:
        self._strategy = strategy
        self._table = table
        self._nodes: dict[str, NodeMetrics] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # The hot series (see the module's docstring): by (node, outcome), (strategy, node), node.
        self.outcomes: dict[tuple[str, str], Tally] = {}
        self.picks: dict[tuple[str, str], Tally] = {}
        self.latency: dict[str, Spread] = {}
        self.ttft: dict[str, Spread] = {}
        r.register(_PerNode(self))
        self.retries = Counter(
            "promptlb_retries",
            "Tries that were retries, by the node that failed.",
            ["node"],
            registry=r,
        )
        self.snapshot_errors = Counter(
            "promptlb_snapshot_errors",
            "Snapshots not taken: unreachable or rejected.",
            ["node", "kind"],
            registry=r,
        )
        self.unavailable = Counter(
            "promptlb_no_node_available",
            "Model hops that found no candidate node: the request's 503 unless a fallback "
            "answered it.",
            ["model"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "promptlb_retry_budget_exhausted", "Retries not made: the budget was spent.", registry=r
        )
        self.fallbacks = Counter(
            "promptlb_fallbacks",
            "Requests that went on to a hop of their fallback chain (counted under each hop "
            "gone on to), for a failure or for no room in the primary's admission queue.",
            ["model", "to"],
            registry=r,
        )
        self.cache = Counter(
            "promptlb_cache_lookups",
            "Response cache lookups, by result (fresh_hit, stale_hit, miss).",
            ["result"],
            registry=r,
        )
        self.cache_errors = Counter(
            "promptlb_cache_errors",
            "Cache operations that failed or were skipped (counted as misses).",
            ["op"],
            registry=r,
        )
        self.index_share_errors = Counter(
            "promptlb_index_share_errors",
            "Exchanges of the prefix index through Redis that failed (write: a round with "
            "records to write, its read included; read) or entries skipped (decode).",
            ["op"],
            registry=r,
        )
        self.index_share_lag = Histogram(
            "promptlb_index_share_lag_seconds",
            "Age of the other replicas' index entries when this replica read them, from "
            "their write to Redis (a record also waits up to one period in its writer's batch).",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.hedges = Counter(
            "promptlb_hedges", "Hedged attempts: sent, won_first, won_hedge.", ["event"], registry=r
        )
        self.shed = Counter(
            "promptlb_shed", "Requests refused with 429 by load shedding.", ["priority"], registry=r
        )
        r.register(_Live(table))

    def use_strategy(self, strategy: str) -> None:
        """A reloaded config names another strategy: picks are counted under it from now."""
        if strategy != self._strategy:
            self._strategy = strategy
            self._nodes.clear()

    def forget_node(self, name: str) -> None:
        """Node ``name`` left the table: its series go. Under DNS discovery every rollout brings
        nodes of new names, whose series would otherwise pile up for good; Prometheus marks the
        ones gone stale. A try still finishing there counts nowhere (`node`)."""
        self._nodes.pop(name, None)
        for key in [k for k in self.outcomes if k[0] == name]:
            del self.outcomes[key]
        for key in [k for k in self.picks if k[1] == name]:
            del self.picks[key]
        self.latency.pop(name, None)
        self.ttft.pop(name, None)
        with contextlib.suppress(KeyError):
            self.retries.remove(name)
        # The kinds this node's snapshot errors were counted under, as the samples name them.
        kinds = {
            sample.labels["kind"]
            for family in self.snapshot_errors.collect()
            for sample in family.samples
            if sample.labels.get("node") == name
        }
        for kind in kinds:
            self.snapshot_errors.remove(name, kind)

    def node(self, name: str) -> NodeMetrics:
        found = self._nodes.get(name)
        if found is None:
            if not self.member(name):
                # A try that outlived its node (a rollout's long stream): series made for it
                # now would stay for good, since the node's leaving was their one removal.
                return NodeMetrics(None, name, self._strategy)
            found = self._nodes[name] = NodeMetrics(self, name, self._strategy)
        return found

    def of(self, node: Node) -> NodeMetrics:
        """`node`'s series, when ``node`` is the table's node of its name: a try still on a
        node a reload replaced (the name now another server's) counts nowhere, where it
        counted against the new server."""
        table = self._table()
        if table is not None and table.nodes.get(node.name) is not node:
            return NodeMetrics(None, node.name, self._strategy)
        return self.node(node.name)

    def member(self, name: str) -> bool:
        """Whether ``name`` is in the node table (whose series may be made)."""
        table = self._table()
        return table is None or name in table.nodes

    def render(self) -> bytes:
        return generate_latest(self.registry)
