"""The live runner's pure parts: the run plan, missing peers, scaled faults, the configs it
writes. (The runs themselves start a cluster and take minutes: `make bench` does them.)"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from promptlb.bench import _live, _peers
from promptlb.bench._live import (
    Cluster,
    Plan,
    gateway_config,
    plan,
    play_faults,
    scaled,
    sidecar_args,
    wait_ready,
)
from promptlb.bench._livereport import Run
from promptlb.bench._loadgen import Result
from promptlb.bench._report import crash_lines, crashes
from promptlb.bench._scenario import Fault, load_scenario
from promptlb.shared import ConfigError

from tests.bench.conftest import running_cluster
from tests.conftest import Serve


def test_plan_runs_ours_and_reports_missing_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_peers, "nginx_missing", lambda: "nginx (not found)")
    monkeypatch.setattr(_peers, "litellm_missing", lambda: None)
    chosen = plan("round_robin,p2c", "nginx,litellm")
    assert chosen.ours == ["round_robin", "p2c"]
    assert chosen.missing == ["missing: nginx (not found)"]
    assert chosen.peers == [("litellm", s) for s in _peers.LITELLM_STRATEGIES]
    assert plan("p2c", "none").peers == []
    # Named twice, each ran twice and the second's results replaced the first's unsaid.
    twice = plan("p2c, round_robin,p2c", "nginx,litellm,nginx , litellm")
    assert twice.ours == ["p2c", "round_robin"]
    assert twice.peers == chosen.peers and twice.missing == chosen.missing


def test_nginx_missing_names_the_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_peers, "NGINX", str(tmp_path / "nginx"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "not found" in (_peers.nginx_missing() or "")


def test_plan_rejects_unknown_names() -> None:
    with pytest.raises(ConfigError, match="strategies"):
        plan("fastest", "none")
    with pytest.raises(ConfigError, match="peers"):
        plan("p2c", "haproxy")
    with pytest.raises(ConfigError, match="X\\+affinity\\+shared"):
        plan("fastest", "none")
    # Nothing to run: the cluster started for nothing, and the run ended writing nothing.
    with pytest.raises(ConfigError, match="at least one"):
        plan(" , ", "none")
    assert plan("", "oracle").peers == [("oracle", "oracle")]


def test_nginx_config_has_the_upstreams_and_passive_checks(tmp_path: Path) -> None:
    nodes = {"a": "http://127.0.0.1:8001", "b": "http://127.0.0.1:8002"}
    conf = _peers.nginx_config("least_conn", nodes, 9000, tmp_path)
    assert "least_conn;" in conf
    assert "server 127.0.0.1:8001 max_fails=3 fail_timeout=10s;" in conf
    assert "server 127.0.0.1:8002 max_fails=3 fail_timeout=10s;" in conf
    assert "proxy_buffering off;" in conf
    assert "listen 127.0.0.1:9000;" in conf
    assert "add_header x-bench-upstream $upstream_addr always;" in conf
    assert f"pid {tmp_path}/nginx.pid;" in conf
    assert (
        "least_conn"
        not in _peers.nginx_config("round_robin", nodes, 9000, tmp_path).split("upstream")[1]
    )
    with pytest.raises(ValueError, match="nginx strategy"):
        _peers.nginx_config("ip_hash", nodes, 9000, tmp_path)


def test_scaled_keeps_the_story_in_a_shorter_run() -> None:
    scenario = load_scenario("seed-3am")
    half, scale = scaled(scenario, scenario.duration / 2)
    assert scale == 0.5
    assert half.duration == scenario.duration / 2
    before = [f.at for n in scenario.nodes for f in n.faults]
    after = [f.at for n in half.nodes for f in n.faults]
    assert after == [t / 2 for t in before]
    assert scaled(scenario, scenario.duration) == (scenario, 1.0)


def test_gateway_config_names_every_node_and_sidecar() -> None:
    cluster = Cluster(load_scenario("uniform-4"))
    text = gateway_config("p2c", cluster)  # no nodes started: only the header
    assert "strategy = 'p2c'" in text
    assert "interval = '1s'" in text


def test_gateway_config_carries_the_scenarios_options_and_trusts_the_class_header() -> None:
    import tomllib

    cluster = Cluster(load_scenario("mixed-class"))
    parsed = tomllib.loads(gateway_config("model_aware", cluster))
    assert parsed["class_header"] == "x-promptlb-class"
    assert parsed["strategy_options"]["routes"]["simple_qa"] == ["light"]
    assert parsed["strategy_options"]["inner"] == "predictive"
    assert "strategy_options" not in tomllib.loads(gateway_config("p2c", cluster))


def test_affinity_runs_configure_the_inner_strategy_under_affinity() -> None:
    import tomllib

    from promptlb.bench._livecache import cache_strategies

    cluster = Cluster(load_scenario("multi-tenant-chat"))
    parsed = tomllib.loads(gateway_config("predictive+affinity", cluster))
    assert parsed["strategy"] == "predictive" and parsed["affinity"] == {}
    assert "affinity" not in tomllib.loads(gateway_config("predictive", cluster))
    assert plan("predictive+affinity", "none").ours == ["predictive+affinity"]
    with pytest.raises(ConfigError):
        plan("fastest+affinity", "none")
    assert cache_strategies(["round_robin", "predictive"]) == [
        "round_robin",
        "predictive",
        "predictive+affinity",
        "predictive+shared",
    ]


def test_shared_runs_configure_the_inner_strategy_sharing_through_the_runs_redis() -> None:
    import tomllib

    cluster = Cluster(load_scenario("multi-tenant-chat"))
    parsed = tomllib.loads(gateway_config("predictive+shared", cluster, "redis://127.0.0.1:1/0"))
    assert parsed["strategy"] == "predictive"
    assert parsed["index_share"] == {"redis": "redis://127.0.0.1:1/0"}
    assert "index_share" not in tomllib.loads(gateway_config("predictive", cluster))
    assert plan("predictive+shared", "none").ours == ["predictive+shared"]
    with pytest.raises(ConfigError):
        plan("fastest+shared", "none")


def test_the_oracle_is_a_peer_that_is_never_missing() -> None:
    chosen = plan("predictive", "oracle")
    assert chosen.peers == [("oracle", "oracle")] and chosen.missing == []


def test_a_nodes_memory_limit_goes_to_its_sidecar_with_a_short_rss_window() -> None:
    nodes = {n.name: n for n in load_scenario("seed-3am").nodes}
    leaky = sidecar_args(nodes["node-c"], "http://127.0.0.1:1")
    assert leaky[leaky.index("--memory-limit-mb") + 1] == "300"
    assert leaky[leaky.index("--rss-window") + 1] == "5s"
    assert "--memory-limit-mb" not in sidecar_args(nodes["node-a"], "http://127.0.0.1:1")


def _result(i: int, start: float, end: float, node: str, error: str = "") -> Result:
    return Result(i, "qa", 40, start, start=start, end=end, status=200, error=error, node=node)


def test_crashes_count_the_requests_lost_and_the_drain_before() -> None:
    results = [
        _result(0, 20.0, 30.1, "c", "truncated"),  # on c when it died
        _result(1, 30.3, 30.4, "?", "http_502"),  # sent to it just after, no node answered
        _result(2, 29.0, 30.5, "c"),  # finished fine
        _result(3, 25.0, 30.2, "a", "truncated"),  # another node's failure
        _result(4, 5.0, 30.6, "?", "http_504"),  # waited out in a queue: not the crash
        _result(5, 31.0, 32.0, "c", "disconnected"),  # more than a second after
        _result(6, 10.0, 12.0, "c", "truncated"),  # before it
    ]
    applied = [
        {"node": "c", "kind": "leak", "at": 15.0, "applied_at": 15.0, "outcome": "ok"},
        {"node": "c", "kind": "crash", "at": 30.0, "applied_at": 30.0, "outcome": "ok"},
        {"node": "c", "kind": "recover", "at": 45.0, "applied_at": 45.0, "outcome": "ok"},
    ]
    states = {
        "a": [[0.5, "ready"]],
        "c": [[0.5, "ready"], [16.2, "leaking"], [30.5, "unhealthy"], [46.0, "ready"]],
    }
    (row,) = crashes(results, applied, states)
    assert row == {
        "node": "c",
        "at": 30.0,
        "lost": 2,
        "lost_errors": {"truncated": 1, "http_502": 1},
        "drained_at": 16.2,
        "drained_before_s": 13.8,
        "ready_again_at": 46.0,
    }
    line = "p: c crashed at 30.0s, 2 requests lost; drained (leaking) at 16.2s, 13.8s before"
    assert crash_lines({"p": {"crashes": [row]}}) == [line + "; ready again at 46.0s"]
    # Not drained; a peer (no states); a crash that failed to play is no crash.
    (bare,) = crashes(results, applied, {"c": [[0.5, "ready"]]})
    assert (bare["drained_at"], bare["ready_again_at"]) == (None, None)
    assert crash_lines({"p": {"crashes": [bare]}}) == [
        "p: c crashed at 30.0s, 2 requests lost; not drained before it"
    ]
    assert "drained_at" not in crashes(results, applied)[0]
    assert crashes(results, [{**applied[1], "outcome": "failed: boom"}]) == []


def test_a_run_that_cannot_start_costs_itself_not_the_runs_already_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cluster's processes left out (the runs take minutes): the second run's reset fails,
    the third's measurement; the report still holds the first run and names both failures
    (the reset's exception escaped and lost every finished run)."""
    resets: list[int] = []

    async def reset(self: Cluster, http: aiohttp.ClientSession) -> None:
        resets.append(1)
        if len(resets) == 2:
            raise aiohttp.ClientConnectionError("an emulator refused the faults reset")

    def target(kind: str, strategy: str, *args: Any) -> _peers.Target:
        url = "http://127.0.0.1:9"
        return _peers.Target(f"{kind} {strategy}", kind, strategy, url, lambda: None)

    async def measure(http: Any, cluster: Cluster, target: _peers.Target, trace: Any) -> Run:
        if target.strategy == "p2c":
            raise TimeoutError
        results = [Result(i, a.prompt_class, a.max_tokens, a.at) for i, a in enumerate(trace)]
        for r in results:
            r.start, r.end, r.status, r.node = r.at, r.at + 1.0, 200, "a"
        return Run(target.name, target.kind, target.strategy, results, [])

    async def nothing(*args: Any) -> None:
        return None

    monkeypatch.setattr(Cluster, "start", lambda self: None)
    monkeypatch.setattr(Cluster, "stop", lambda self: None)
    monkeypatch.setattr(Cluster, "reset", reset)
    monkeypatch.setattr(_live, "_start_target", target)
    monkeypatch.setattr(_live, "measure", measure)
    monkeypatch.setattr(_live, "wait_ready", nothing)
    scenario = load_scenario("uniform-4")
    chosen = Plan(["round_robin", "least_conn", "p2c"], [], [])
    report, plots = asyncio.run(_live.run_all(scenario, chosen, {}))
    assert list(plots) == ["promptlb round_robin"]
    assert "could not be reset" in report["failed"]["promptlb least_conn"]
    assert report["failed"]["promptlb p2c"].startswith("TimeoutError")


def test_a_peer_starting_as_the_run_is_interrupted_is_stopped_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start runs in a thread that a cancel does not stop: the nginx it started (no
    Service, so nothing stops it at exit) outlived the bench."""
    stopped: list[str] = []
    began = threading.Event()

    def target(kind: str, strategy: str, *args: Any) -> _peers.Target:
        began.set()
        time.sleep(0.3)  # still starting when the cancel lands
        return _peers.Target(
            f"{kind} {strategy}", kind, strategy, "http://127.0.0.1:9", lambda: stopped.append(kind)
        )

    async def reset(self: Cluster, http: aiohttp.ClientSession) -> None:
        return None

    monkeypatch.setattr(Cluster, "start", lambda self: None)
    monkeypatch.setattr(Cluster, "stop", lambda self: None)
    monkeypatch.setattr(Cluster, "reset", reset)
    monkeypatch.setattr(_live, "_start_target", target)

    async def interrupted() -> None:
        plan_ = Plan([], [("nginx", "round_robin")], [])
        run = asyncio.ensure_future(_live.run_all(load_scenario("uniform-4"), plan_, {}))
        await asyncio.to_thread(began.wait, 5.0)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(interrupted())
    assert stopped == ["nginx"]


def test_a_live_run_where_every_run_failed_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A report of failures alone replaced the committed results by the same name, and the
    command exited 0."""

    async def run_all(*args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"runs": {}, "failed": {"promptlb p2c": "the cluster could not be reset"}}, {}

    monkeypatch.setattr(_live, "run_all", run_all)
    args = argparse.Namespace(
        scenario="uniform-4",
        duration=None,
        strategies="p2c",
        peers="none",
        replicas=8,
        out=str(tmp_path),
        no_plot=True,
    )
    with pytest.raises(SystemExit, match="no run succeeded, nothing written"):
        _live.run_cluster(args)
    assert list(tmp_path.iterdir()) == []


def test_two_restarts_of_one_node_at_once_leave_it_up_on_its_port(tmp_path: Path) -> None:
    # A recover's restart runs on in its thread after its run is cancelled; the next run's
    # reset restarted the same node beside it, on the same port, and one failed to listen.
    scenario = (
        'duration = "1s"\n[workload]\nload = 0.5\n[[workload.mix]]\nname = "q"\n'
        "prompt_tokens = 10\nmax_tokens = 5\n"
        '[[nodes]]\nname = "n"\nttft_ms = 5\n'
    )
    with running_cluster(tmp_path / "one.toml", scenario) as cluster:
        port = cluster.nodes["n"].model.port
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(cluster.restart, ["n", "n"]))  # raises if either failed
        node = cluster.nodes["n"]
        assert node.alive and node.model.port == port
        with urllib.request.urlopen(node.model.url + "/health", timeout=5) as response:
            assert response.status == 200


async def test_a_status_of_another_shape_is_asked_again_not_the_run_lost(serve: Serve) -> None:
    # A 200 without "nodes" (something else answering first) raised KeyError and lost the run.
    answers = [{}, {"nodes": [{"state": "ready", "snapshot_trusted": True}]}]

    async def status(request: web.Request) -> web.Response:
        return web.json_response(answers.pop(0) if len(answers) > 1 else answers[0])

    app = web.Application()
    app.router.add_get("/_promptlb/status", status)
    async with serve(app) as url, aiohttp.ClientSession() as http:
        target = _peers.Target("gw", "promptlb", "predictive", url, stop=lambda: None)
        await asyncio.wait_for(wait_ready(http, target, 1), 10)
    assert len(answers) == 1


async def test_a_nodes_slow_restart_holds_back_no_other_nodes_faults() -> None:
    """A recover's restart takes seconds; played one after another, every fault due on
    another node meanwhile came late (its lateness only in ``applied_at``)."""
    calls: list[tuple[str, str]] = []

    async def apply(name: str, fault: Fault) -> None:
        calls.append((name, fault.kind))
        if fault.kind == "recover":
            await asyncio.sleep(0.6)  # a restart
        if fault.kind == "slow" and name == "b":
            raise RuntimeError("refused")

    schedule = [
        (0.0, "a", Fault(at=0.0, kind="recover")),
        (0.1, "b", Fault(at=0.1, kind="slow", value=3.0)),
        (0.2, "a", Fault(at=0.2, kind="crash")),  # after a's restart, in a's order
        (9.0, "b", Fault(at=9.0, kind="hang")),  # past the trace: never played
    ]
    applied: list[dict[str, Any]] = []
    start = asyncio.get_running_loop().time()
    await play_faults(schedule, 5.0, start, apply, applied)
    by = {(a["node"], a["kind"]): a for a in applied}
    assert by[("b", "slow")]["applied_at"] < 0.4  # not behind a's restart
    assert by[("b", "slow")]["outcome"] == "failed: refused"
    assert by[("a", "crash")]["applied_at"] >= 0.6  # a's own faults keep their order
    assert calls.index(("a", "recover")) < calls.index(("a", "crash"))
    assert ("b", "hang") not in calls
