"""The shipped alerts through promtool, and a real Prometheus scraping a real gateway and its
sidecars: the series exist with sane values, the alerts evaluate, every Grafana panel answers."""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.conftest import Launcher, sidecar_args
from tests.ops.conftest import EXAMPLES, Prometheus, StartPrometheus

ALERTS = EXAMPLES / "prometheus" / "alerts.yml"
DASHBOARD = EXAMPLES / "grafana" / "promptlb.json"
ADMIN_TOKEN = "ops-admin-token"
FAST = ("--ttft-ms", "20", "--tokens-per-s", "400")


def test_the_alert_rules_pass_promtool_check(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    shipped = len(re.findall(r"- alert: ", ALERTS.read_text()))
    assert f"SUCCESS: {shipped} rules found" in result.stdout


def test_the_alert_rules_pass_their_unit_tests(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"],
        cwd=ALERTS.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_unit_test() -> None:
    tested = set(re.findall(r"alertname: (\w+)", (ALERTS.parent / "alerts_test.yml").read_text()))
    shipped = set(re.findall(r"- alert: (\w+)", ALERTS.read_text()))
    assert shipped == tested


def _panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, rows included."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


async def _chat(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    stream: bool = False,
    headers: dict[str, str] | None = None,
) -> int:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": stream,
    }
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        await response.read()
        return response.status


async def _faults(http: aiohttp.ClientSession, url: str, **faults: Any) -> None:
    async with http.post(url + "/_emulator/faults", json=faults) as response:
        assert response.status == 200, await response.text()


async def _traffic(gateway: str, big: str, small: str) -> dict[str, int]:
    """Answers, fallbacks, cache answers and shed requests, in that order; the counts by status."""
    statuses: dict[int, int] = {}

    def count(status: int) -> None:
        statuses[status] = statuses.get(status, 0) + 1

    async with aiohttp.ClientSession() as http:
        for i in range(12):  # answered and cached (temperature 0)
            count(await _chat(http, gateway, "big", f"question {i}"))
            # Streamed: a time to first token is a stream's (a whole answer's has none).
            count(await _chat(http, gateway, "small", f"small question {i}", stream=True))
        # Saturate `small` (one slot, max_in_flight 1): sheddable requests get 429 at once.
        shed = [
            _chat(http, gateway, "small", f"shed {i}", headers={"x-promptlb-priority": "sheddable"})
            for i in range(6)
        ]
        for status in await asyncio.gather(*shed):
            count(status)
        await _faults(http, big, error_rate=1.0)  # big fails: its chain falls back to small
        for i in range(4):
            count(await _chat(http, gateway, "big", f"fallback {i}"))
        await _faults(http, small, error_rate=1.0)  # both fail: the cache hop answers
        for i in range(4):
            count(await _chat(http, gateway, "big", f"question {i}"))
        await _faults(http, big, error_rate=0.0)
        await _faults(http, small, error_rate=0.0)
    return {str(k): v for k, v in statuses.items()}


def _values(result: list[dict[str, Any]]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


def _wait_for(prom: Prometheus, expr: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        result = prom.query(expr)
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_a_real_prometheus_scrapes_the_gateway_and_sidecars(
    launch: Launcher, prometheus: StartPrometheus, fake_nvml: None, tmp_path: Path
) -> None:
    big = launch("emulator", "--model", "big", *FAST)
    small = launch("emulator", "--model", "small", "--slots", "1", *FAST)
    sidecars = {
        name: launch("sidecar", *sidecar_args(model.url, name))
        for name, model in (("node-big", big), ("node-small", small))
    }
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN + "\n")
    config = tmp_path / "promptlb.toml"
    config.write_text(
        f"""
strategy = "p2c"
admin_token_file = "{token}"
[health]
interval = "200ms"
[retry]
attempts = 1
[[fallback]]
model = "big"
then = ["small", "cache"]
[cache]
backend = "memory"
[shedding]
enabled = true
max_in_flight = 1
queue_size = 0
[[nodes]]
name = "node-big"
url = "{big.url}"
sidecar = "{sidecars["node-big"].url}"
models = ["big"]
[[nodes]]
name = "node-small"
url = "{small.url}"
sidecar = "{sidecars["node-small"].url}"
models = ["small"]
"""
    )
    gateway = launch("middleware", "--config", str(config), "--log-level", "warning")
    prom = prometheus(
        {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {
                    "job_name": "promptlb-gateway",
                    "metrics_path": "/_promptlb/metrics",
                    "authorization": {"type": "Bearer", "credentials_file": str(token)},
                    "static_configs": [{"targets": [gateway.url.removeprefix("http://")]}],
                },
                {
                    "job_name": "promptlb-sidecar",
                    "static_configs": [
                        {"targets": [s.url.removeprefix("http://") for s in sidecars.values()]}
                    ],
                },
            ],
        }
    )
    assert _wait_for(prom, "count(up == 1) == 3"), prom.log()
    statuses = asyncio.run(_traffic(gateway.url, big.url, small.url))
    assert statuses.get("429", 0) >= 1, statuses  # shed
    assert statuses["200"] >= 24 + 4 + 4, statuses  # answers, fallbacks, cache answers
    # A scrape after the last request (the tries answered 200: 12 on each node, 4 fallbacks;
    # the cache answers are no tries), waited for, then a few more for the rates.
    assert _wait_for(prom, 'sum(promptlb_requests_total{outcome="200"}) >= 28'), prom.log()
    time.sleep(2)

    # Every target up, and the gateway's view of its nodes.
    assert sorted(_values(prom.query("up"))) == [1.0, 1.0, 1.0]
    ready = {s["metric"]["node"]: float(s["value"][1]) for s in prom.query("promptlb_node_ready")}
    assert set(ready) == {"node-big", "node-small"} and set(ready.values()) <= {0.0, 1.0}
    assert all(0 <= v <= 1 for v in _values(prom.query("promptlb_node_ramp_ratio")))
    assert all(v >= 0 for v in _values(prom.query("promptlb_in_flight_requests")))

    # Counters end _total; what they counted is what was sent.
    tries = prom.query('sum by (node) (promptlb_requests_total{outcome="200"})')
    answered = {s["metric"]["node"]: float(s["value"][1]) for s in tries}
    assert answered["node-big"] >= 12 and answered["node-small"] >= 12 + 4, answered
    failed = prom.query('sum(promptlb_requests_total{node="node-big",outcome="500"})')
    # Each fallback was a 500 from node-big: its failure, not an abort (then it was ejected).
    assert _values(failed)[0] >= 4
    assert not prom.query('promptlb_requests_total{outcome="aborted"}')
    fallbacks = prom.query('promptlb_fallbacks_total{model="big",to="small"}')
    assert _values(fallbacks)[0] >= 8
    assert _values(prom.query('promptlb_cache_lookups_total{result="stale_hit"}'))[0] == 4
    assert _values(prom.query('sum(promptlb_shed_total{priority="sheddable"})'))[0] >= 1
    picks = prom.query('sum(promptlb_picks_total{strategy="p2c"})')
    assert _values(picks)[0] >= 24

    # Histograms in seconds, with buckets up to minutes; the emulators answer in well under 1 s.
    buckets = {s["metric"]["le"] for s in prom.query("promptlb_latency_seconds_bucket")}
    assert {"600.0", "+Inf"} <= buckets and "0.005" in buckets
    assert {s["metric"]["le"] for s in prom.query("promptlb_ttft_seconds_bucket")} == buckets
    p99 = _values(
        prom.query(
            "histogram_quantile(0.99, sum by (le) (rate(promptlb_latency_seconds_bucket[1m])))"
        )
    )
    assert 0 < p99[0] < 2, p99
    mean_ttft = _values(
        prom.query("sum(promptlb_ttft_seconds_sum) / sum(promptlb_ttft_seconds_count)")
    )
    assert 0.01 < mean_ttft[0] < 1, mean_ttft

    # The sidecars: host, engine, the model server's memory, and the (stand-in) GPUs per card.
    ratios = ("cpu_utilization_ratio", "memory_utilization_ratio", "engine_kv_cache_usage_ratio")
    for name in ratios:
        values = _values(prom.query(f"promptlb_sidecar_{name}"))
        assert len(values) == 2 and all(0 <= v <= 1 for v in values), (name, values)
    assert all(v > 2**20 for v in _values(prom.query("promptlb_sidecar_model_rss_bytes")))
    slopes = _values(prom.query("promptlb_sidecar_model_rss_slope_bytes_per_second"))
    assert len(slopes) == 2 and all(math.isfinite(v) for v in slopes)
    assert all(v > 2**30 for v in _values(prom.query("promptlb_sidecar_memory_total_bytes")))
    free = _values(prom.query("promptlb_sidecar_model_memory_free_bytes"))
    assert len(free) == 2 and all(v > 0 for v in free), free
    for name in ("engine_running_requests", "engine_waiting_requests"):
        assert all(v >= 0 for v in _values(prom.query(f"promptlb_sidecar_{name}")))
    gpu = prom.query("promptlb_sidecar_gpu_utilization_ratio")
    assert sorted(_values(gpu)) == [0.35, 0.35, 0.87, 0.87]
    assert {s["metric"]["gpu"] for s in gpu} == {"0", "1"}
    used = prom.query("promptlb_sidecar_gpu_memory_used_bytes")
    assert sorted(_values(used))[-1] == 70_000 * 2**20
    assert _values(prom.query("sum(promptlb_sidecar_ready)"))[0] == 2
    assert _values(prom.query("sum(promptlb_sidecar_snapshot_requests_total)"))[0] > 0

    # Nothing exported breaks the conventions: counters end _total, no unit-less ratios.
    names = set(prom.api("label/__name__/values"))
    ours = {n for n in names if n.startswith("promptlb_")}
    metadata = prom.api("metadata")
    for name in ours:
        kinds = {m["type"] for m in metadata.get(name, [])}
        if "counter" in kinds:
            assert name.endswith("_total"), name
        if "utilization" in name or "usage" in name or "ramp" in name:
            assert name.endswith("_ratio"), name

    # The alert rules loaded and evaluate against real series without errors.
    groups = prom.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(re.findall(r"- alert: ", ALERTS.read_text()))
    # The gateway and both model servers answer: the alerts that say otherwise stay quiet.
    state = {rule["name"]: rule["state"] for rule in rules}
    assert state["PromptLBGatewayDown"] == state["PromptLBModelServerDown"] == "inactive"
    assert all(rule["health"] == "ok" for rule in rules), [
        (r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"
    ]

    # Every panel of the Grafana board answers with data.
    for title, expr in _panel_queries():
        query = expr.replace("$__rate_interval", "1m")
        assert "$" not in query, (title, query)
        result = prom.query(query)
        finite = [v for v in _values(result) if math.isfinite(v)]
        assert finite, f"panel {title!r}: {query} returned {result}"


def test_the_stacks_prometheus_config_is_valid(promtool: str) -> None:
    # Not prometheus-k8s.yml: Debian builds Prometheus without Kubernetes service discovery,
    # so its promtool refuses kubernetes_sd_configs (tests/ops/test_k8s.py checks that file).
    path = EXAMPLES / "prometheus" / "prometheus.yml"
    result = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
