"""The status document the dashboard draws, and who may open the dashboard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from promptlb.middleware import PromptLBMiddleware
from promptlb.middleware._nodes import RECENT
from promptlb.middleware._status import StatusPage, jain_index, percentile, status_json

from tests.conftest import Launcher, Serve
from tests.middleware.conftest import MakeSnapshot, gateway_over

DEAD = "http://127.0.0.1:9"
ROOT = Path(__file__).resolve().parents[2]


def config(**extra: Any) -> dict[str, Any]:
    return {
        "nodes": [
            {"name": "a", "url": DEAD, "models": ["m"]},
            {"name": "b", "url": DEAD, "models": ["m"]},
        ],
        "health": {"enabled": False},
        **extra,
    }


def test_jain_index_and_percentiles() -> None:
    assert jain_index([5, 5, 5, 5]) == 1.0
    assert jain_index([8, 0, 0, 0]) == 0.25  # one node takes it all: 1/n
    assert jain_index([0, 0]) is None and jain_index([]) is None
    ordered = [float(i) for i in range(1, 101)]
    assert [percentile(ordered, p) for p in (0.5, 0.9, 0.99)] == [50.0, 90.0, 99.0]
    assert percentile([3.0], 0.99) == 3.0


def test_percentiles_rates_share_and_totals(snap: MakeSnapshot) -> None:
    app = PromptLBMiddleware(None, config=config())  # type: ignore[arg-type]
    lb = app.balancer
    a, b = lb.table.nodes["a"], lb.table.nodes["b"]
    for _ in range(100):  # older than the last RECENT answers: not counted
        lb.table.record_result(a, True, 10.0, 0.01, 0.0)
    for i in range(RECENT):
        lb.table.record_result(a, True, (i + 1) / 1000, 0.01, 0.0)
    assert len(a.recent_latency_s) == RECENT
    lb.table.record_result(b, False, None, None, 0.0)
    engine_snap = snap("a", gpus=[0.5, 0.7], running=3, waiting=2, kv_cache=0.4, tps=120.0)
    lb.table.record_snapshot(a, engine_snap, lb.table._clock())
    lb.table.tick(lb.table._clock())
    lb.metrics.fallbacks.labels("m", "small").inc(2)
    lb.metrics.cache.labels("stale_hit").inc()
    lb.metrics.cache.labels("fresh_hit").inc()
    lb.metrics.cache.labels("miss").inc(5)
    lb.metrics.shed.labels("sheddable").inc(3)

    page = StatusPage()
    first = page.render(lb)
    node_a = first["nodes"][0]
    assert node_a["latency_ms"]["samples"] == RECENT
    assert node_a["latency_ms"] == {"p50": 128.0, "p90": 231.0, "p99": 254.0, "samples": RECENT}
    assert node_a["ttft_ms"]["p90"] == 10.0
    assert [g["util"] for g in node_a["gpus"]] == [0.5, 0.7]
    assert node_a["engine"] == {"running": 3, "waiting": 2, "kv_cache": 0.4, "tps": 120.0}
    assert first["nodes"][1]["latency_ms"] == {"p50": None, "p90": None, "p99": None, "samples": 0}
    totals = first["totals"]
    assert totals["fallbacks"] == 2 and totals["cache_answers"] == 2 and totals["shed"] == 3
    assert totals["tokens_per_s"] == 120.0
    # The first look has no span: shares and success over everything counted so far.
    assert totals["qps"] is None and totals["window_s"] is None
    assert node_a["share"] == round(356 / 357, 4)
    assert totals["success_rate"] == round(356 / 357, 4)

    # A second look a second later: rates over the span between the two readings.
    page._readings[0] = (page._readings[0][0] - 1.0, page._readings[0][1])
    for _ in range(30):
        lb.table.record_result(a, True, 0.1, 0.01, 0.0)
    for _ in range(10):
        lb.table.record_result(b, True, 0.1, 0.01, 0.0)
    second = page.render(lb)
    totals = second["totals"]
    assert totals["window_s"] == pytest.approx(1.0, abs=0.1)
    assert totals["qps"] == pytest.approx(40.0, rel=0.1)
    assert totals["success_rate"] == 1.0
    assert [n["share"] for n in second["nodes"]] == [0.75, 0.25]
    assert totals["balance_index"] == jain_index([30, 10])


def test_a_leaking_node_is_marked(snap: MakeSnapshot) -> None:
    app = PromptLBMiddleware(None, config=config())  # type: ignore[arg-type]
    lb = app.balancer
    a = lb.table.nodes["a"]
    leaking = snap("a")
    object.__setattr__(leaking, "rss", 2 * 2**30)
    object.__setattr__(leaking, "rss_slope", 1e6)  # 3.6 GB an hour on 2 GiB
    lb.table.record_snapshot(a, leaking, lb.table._clock())
    lb.table.tick(lb.table._clock())
    doc = status_json(lb)
    assert [n["leaking"] for n in doc["nodes"]] == [True, False]
    assert doc["nodes"][0]["rss_slope_bytes_per_s"] == 1e6


async def get(app: PromptLBMiddleware, path: str, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 5000))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        return await http.get(path, headers=headers)


async def test_dashboard_is_closed_without_a_token_and_its_data_needs_one() -> None:
    closed = PromptLBMiddleware(None, config=config())  # type: ignore[arg-type]
    assert (await get(closed, "/_promptlb/")).status_code == 403
    assert (await get(closed, "/_promptlb/dashboard.js")).status_code == 403

    app = PromptLBMiddleware(None, config=config(admin_token="s3cret-token"))  # type: ignore[arg-type]
    redirect = await get(app, "/_promptlb")
    assert redirect.status_code == 308 and redirect.headers["location"] == "/_promptlb/"
    page = await get(app, "/_promptlb/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["referrer-policy"] == "no-referrer"
    assert "s3cret" not in page.text  # a shell: no data, no token
    script = await get(app, "/_promptlb/dashboard.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert "sessionStorage" in script.text and "Authorization" in script.text
    assert (await get(app, "/_promptlb/dashboard.css")).status_code == 200
    assert (await get(app, "/_promptlb/status")).status_code == 401
    wrong = await get(app, "/_promptlb/status", authorization="Bearer nope")
    assert wrong.status_code == 401
    status = await get(app, "/_promptlb/status", authorization="Bearer s3cret-token")
    assert status.status_code == 200 and {n["name"] for n in status.json()["nodes"]} == {"a", "b"}


def test_dashboard_files_are_package_data() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"promptlb.middleware" = ["dashboard/*"]' in pyproject
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        assert (ROOT / "middleware" / "dashboard" / name).is_file()


async def test_status_of_a_live_node(launch: Launcher) -> None:
    model = launch("emulator", "--model", "m", "--ttft-ms", "5", "--tokens-per-s", "2000")
    app = PromptLBMiddleware(
        None,  # type: ignore[arg-type]
        config={"nodes": [{"name": "a", "url": model.url, "models": ["m"]}], "admin_token": "t"},
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for _ in range(5):
            ask = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
            answer = await http.post("/v1/chat/completions", json=ask)
            assert answer.status_code == 200
        doc = (await http.get("/_promptlb/status", headers={"authorization": "Bearer t"})).json()
    (node,) = doc["nodes"]
    assert node["state"] == "ready" and node["requests"] == 5
    assert node["latency_ms"]["samples"] == 5 and node["latency_ms"]["p50"] > 0
    assert doc["totals"]["success_rate"] == 1.0 and doc["totals"]["nodes_ready"] == 1
    await app.dispatcher.stop()


async def test_a_node_refusing_every_request_shows_its_refusals_not_failures(
    serve: Serve,
) -> None:
    """A node with a wrong key answers 401 to everything: healthy, no failure of its own, and
    before the refusals count nothing on the page said why its requests all came back 4xx."""

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "bad key"}}, status=401)

    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "slow down"}}, status=429)

    ask = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    routes = {"/v1/chat/completions": refuse, "/v1/completions": busy}
    async with gateway_over(serve, routes, admin_token="t") as (_app, http):
        for _ in range(3):
            assert (await http.post("/v1/chat/completions", json=ask)).status_code == 401
        await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        doc = (await http.get("/_promptlb/status", headers={"authorization": "Bearer t"})).json()
    (node,) = doc["nodes"]
    # The 429 is the node's (no answer), not a refusal; the 401s are refusals, not failures.
    assert (node["refusals"], node["requests"]) == (3, 4)
    assert (node["failures"], node["request_faults"]) == (1, 0)


@pytest.mark.parametrize(("strategy", "queue"), [("p2c", 3 + 4), ("resource", 3)])
def test_the_score_shown_is_the_one_the_strategy_ranks_by(
    snap: MakeSnapshot, strategy: str, queue: int
) -> None:
    """p2c counts our requests since the snapshot into the queue; resource reads the snapshot
    alone. The status page showed p2c's view for both."""
    app = PromptLBMiddleware(None, config=config(strategy=strategy))  # type: ignore[arg-type]
    lb = app.balancer
    a = lb.table.nodes["a"]
    lb.table.record_snapshot(a, snap("a", running=3), lb.table._clock())
    lb.table.tick(lb.table._clock())
    a.view.in_flight = 4  # ours, sent since the snapshot
    nodes = {n["name"]: n for n in status_json(lb)["nodes"]}
    assert nodes["a"]["score"]["queue"] == queue


def test_a_poller_slower_than_the_window_gets_rates_since_its_last_look() -> None:
    # Every reading was older than the window by the next look: no base was left, and a script
    # polling every 15 s got qps null and success over the whole life (here 1000 old failures).
    app = PromptLBMiddleware(None, config=config())  # type: ignore[arg-type]
    lb = app.balancer
    a = lb.table.nodes["a"]
    for _ in range(1000):
        lb.table.record_result(a, False, None, None, 0.0)
    page = StatusPage()
    page.render(lb)
    page._readings[0] = (page._readings[0][0] - 15.0, page._readings[0][1])
    for _ in range(150):
        lb.table.record_result(a, True, 0.1, 0.01, 0.0)
    totals = page.render(lb)["totals"]
    assert totals["window_s"] == pytest.approx(15.0, abs=0.5)
    assert totals["qps"] == pytest.approx(10.0, rel=0.05)
    assert totals["success_rate"] == 1.0
