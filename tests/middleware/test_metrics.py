"""The hot series kept as plain numbers expose what prometheus-client's own would."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from promptlb.middleware import Config, NodeConfig
from promptlb.middleware._balancer import Balancer
from promptlb.middleware._metrics import _LATENCY_BUCKETS, Metrics


def samples(text: bytes, family: str) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    return {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for f in text_string_to_metric_families(text.decode())
        if f.name == family
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_hot_series_match_prometheus_clients_own() -> None:
    ours = Metrics(lambda: None, "p2c")
    theirs = CollectorRegistry()
    requests = Counter("promptlb_requests", "x", ["node", "outcome"], registry=theirs)
    picks = Counter("promptlb_picks", "x", ["strategy", "node"], registry=theirs)
    latency = Histogram(
        "promptlb_latency_seconds", "x", ["node"], buckets=_LATENCY_BUCKETS, registry=theirs
    )
    # On a bound, between bounds, past the last one, and below the first.
    observed = {"a": [0.005, 0.3, 1.0, 700.0, 0.0001], "b": [2.5]}
    for node, values in observed.items():
        mine = ours.node(node)
        for value in values:
            mine.picks.inc()
            picks.labels("p2c", node).inc()
            mine.outcome("200").inc()
            requests.labels(node, "200").inc()
            mine.latency.observe(value)
            latency.labels(node).observe(value)
    ours.node("a").outcome("500").inc(2)
    requests.labels("a", "500").inc(2)
    rendered, expected = ours.render(), generate_latest(theirs)
    for family in ("promptlb_requests", "promptlb_picks", "promptlb_latency_seconds"):
        assert samples(rendered, family) == samples(expected, family)
        assert samples(rendered, family)


def test_picks_stay_counted_under_the_strategy_that_made_them() -> None:
    metrics = Metrics(lambda: None, "least_conn")
    metrics.node("a").picks.inc()
    metrics.use_strategy("weighted")
    metrics.node("a").picks.inc(2)
    text = metrics.render().decode()
    assert 'promptlb_picks_total{node="a",strategy="least_conn"} 1.0' in text
    assert 'promptlb_picks_total{node="a",strategy="weighted"} 2.0' in text


def test_a_try_that_outlives_its_node_brings_none_of_its_series_back() -> None:
    # A rollout's node leaves DNS while a long stream still runs there: the try's end made the
    # node's series again, and nothing would ever remove them a second time.
    a, b = (NodeConfig(name=n, url="http://127.0.0.1:9") for n in "ab")
    lb = Balancer(Config(nodes=(a, b)))
    gone = lb.table.nodes["a"]
    lb.metrics.node("a").outcome("200").inc()
    lb.metrics.retries.labels("a").inc()
    lb.table.reconfigure(Config(nodes=(b,)))
    assert 'node="a"' not in lb.metrics.render().decode()
    lb._finish(gone, ok=True, started=time.monotonic() - 0.1, ttft=0.05, outcome="200")
    lb.metrics.node("a").picks.inc()
    assert lb.metrics.node("a") is not lb.metrics.node("a")  # counted nowhere, kept nowhere
    lb.metrics.node("b").outcome("200").inc()
    text = lb.metrics.render().decode()
    assert 'node="a"' not in text
    assert 'promptlb_requests_total{node="b",outcome="200"} 1.0' in text


def test_a_try_on_a_node_a_reload_replaced_counts_against_neither() -> None:
    # The name is now another server's: the old server's late failures counted in the new
    # server's series (and its error-rate alert).
    lb = Balancer(Config(nodes=(NodeConfig(name="a", url="http://127.0.0.1:9"),)))
    old = lb.table.nodes["a"]
    lb.table.reconfigure(Config(nodes=(NodeConfig(name="a", url="http://127.0.0.1:10"),)))
    assert lb.table.nodes["a"] is not old
    lb._finish(old, ok=False, started=time.monotonic() - 0.1, ttft=None, outcome="500")
    assert 'outcome="500"' not in lb.metrics.render().decode()


def test_a_models_last_node_ejected_is_not_ready_but_serving() -> None:
    """Kept as its model's last node while ejected (its health checks pass), it takes every
    request; the ready gauge alone read 0, and the alerts paged "no node" while it served."""
    from promptlb.middleware._config import load_config
    from promptlb.middleware._nodes import NodeTable

    now = [1000.0]
    config = load_config({"nodes": [{"name": "a", "url": "http://a:8000", "models": ["m"]}]})
    table = NodeTable(config, clock=lambda: now[0])
    node = table.nodes["a"]
    node.health_ok = True
    for _ in range(10):
        table.record_result(node, False, None, None, now[0])
    assert table.state_of(node) == "ejected"
    assert [v.name for v in table.candidates("m") or ()] == ["a"]
    text = Metrics(lambda: table, "p2c").render().decode()
    assert 'promptlb_node_ready{node="a"} 0.0' in text
    assert 'promptlb_node_serving{node="a"} 1.0' in text
