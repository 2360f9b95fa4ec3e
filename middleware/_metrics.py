"""The middleware's Prometheus metrics, in a registry of its own (two middlewares in one
process do not collide)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._nodes import NodeTable

__all__ = ["Metrics", "NodeMetrics"]

# LLM answers: milliseconds (a cached or tiny answer) to minutes (a long generation behind a
# queue). Doubling from 1 s keeps P99 readable where SLOs sit; the last bound is 10 minutes.
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600
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
            "promptlb_node_ready", "1 when a node takes requests.", labels=["node"]
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
            leaking.add_metric([name], 1.0 if state == "leaking" else 0.0)
            ramp.add_metric([name], node.view.ramp)
        yield in_flight
        yield ready
        yield leaking
        yield ramp


class NodeMetrics:
    """One node's labelled series, looked up once: ``labels()`` costs a lock and a tuple per
    call, and the hot path touches four series per request."""

    __slots__ = ("_metrics", "_name", "_outcomes", "latency", "picks", "ttft")

    def __init__(self, metrics: Metrics, name: str, strategy: str) -> None:
        self._metrics = metrics
        self._name = name
        self.picks: Counter = metrics.picks.labels(strategy, name)
        self.latency: Histogram = metrics.latency.labels(name)
        self.ttft: Histogram = metrics.ttft.labels(name)
        self._outcomes: dict[str, Counter] = {}

    def outcome(self, outcome: str) -> Counter:
        counter = self._outcomes.get(outcome)
        if counter is None:
            counter = self._metrics.requests.labels(self._name, outcome)
            self._outcomes[outcome] = counter
        return counter


class Metrics:
    def __init__(self, table: Callable[[], NodeTable | None], strategy: str = "") -> None:
        self._strategy = strategy
        self._nodes: dict[str, NodeMetrics] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "promptlb_requests",
            "Tries sent to a node, by outcome.",
            ["node", "outcome"],
            registry=r,
        )
        self.latency = Histogram(
            "promptlb_latency_seconds",
            "Time to the end of the answer.",
            ["node"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "promptlb_ttft_seconds",
            "Time to the first byte of the answer.",
            ["node"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "promptlb_retries",
            "Tries that were retries, by the node that failed.",
            ["node"],
            registry=r,
        )
        self.picks = Counter("promptlb_picks", "Strategy picks.", ["strategy", "node"], registry=r)
        self.snapshot_errors = Counter(
            "promptlb_snapshot_errors",
            "Snapshots not taken: unreachable or rejected.",
            ["node", "kind"],
            registry=r,
        )
        self.unavailable = Counter(
            "promptlb_no_node_available",
            "Requests answered 503: no candidate node.",
            ["model"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "promptlb_retry_budget_exhausted", "Retries not made: the budget was spent.", registry=r
        )
        self.fallbacks = Counter(
            "promptlb_fallbacks",
            "Requests that went on to the next hop of their fallback chain.",
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

    def node(self, name: str) -> NodeMetrics:
        found = self._nodes.get(name)
        if found is None:
            found = self._nodes[name] = NodeMetrics(self, name, self._strategy)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
