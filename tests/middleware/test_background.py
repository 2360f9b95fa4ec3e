"""Gossip and discovery against real processes, with the balancer in process."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from promptlb.middleware import Config, DiscoveryConfig, HealthConfig, NodeConfig
from promptlb.middleware._background import Evidence, _Gate
from promptlb.middleware._balancer import Balancer
from promptlb.shared import encode, load_key_file, load_keys

from tests.conftest import Launcher, Serve, sidecar_args
from tests.middleware.conftest import MakeSnapshot


async def test_unsigned_snapshots_are_rejected_and_counted_when_a_key_is_set(
    launch: Launcher, tmp_path: Path
) -> None:
    model = launch("emulator", "--ttft-ms", "5")
    sidecar = launch(
        "sidecar", "--model-url", model.url, "--node-name", "a", "--no-warmup-required"
    )
    key = tmp_path / "key"
    key.write_text("k1:a-long-enough-shared-secret\n")
    config = Config(
        nodes=(NodeConfig(name="a", url=model.url, sidecar=sidecar.url),),
        sign_key_file=str(key),
        gossip_interval=0.1,
    )
    lb = Balancer(config)
    await lb.start()
    try:
        await asyncio.sleep(0.5)
        node = lb.table.nodes["a"]
        assert node.snapshot is None  # never trusted
        assert node.snapshot_errors >= 3
        assert b'promptlb_snapshot_errors_total{kind="rejected",node="a"}' in lb.metrics.render()
    finally:
        await lb.stop()


async def test_signed_snapshots_are_taken(launch: Launcher, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k1:a-long-enough-shared-secret\n")
    model = launch("emulator", "--ttft-ms", "5")
    sidecar = launch(
        "sidecar",
        "--model-url",
        model.url,
        "--node-name",
        "a",
        "--no-warmup-required",
        "--sign-key-file",
        str(key),
    )
    config = Config(
        nodes=(NodeConfig(name="a", url=model.url, sidecar=sidecar.url),),
        sign_key_file=str(key),
        gossip_interval=0.1,
    )
    lb = Balancer(config)
    await lb.start()
    try:
        deadline = time.monotonic() + 5
        while lb.table.nodes["a"].snapshot is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert lb.table.nodes["a"].snapshot_errors == 0
    finally:
        await lb.stop()


def dns_config(**discovery: Any) -> Config:
    """A gateway's config under DNS discovery, ``discovery`` its settings, no health checks."""
    return Config(
        discovery=DiscoveryConfig(mode="dns", **discovery), health=HealthConfig(enabled=False)
    )


def resolve_to(monkeypatch: pytest.MonkeyPatch, *addresses: str) -> dict[str, list[str]]:
    """DNS answers ``addresses`` (port 8000) from now on; change ``["now"]`` of what is
    returned to change them."""
    answers = {"now": list(addresses)}

    async def getaddrinfo(*args: Any, **kwargs: Any) -> Any:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 8000)) for a in answers["now"]]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    return answers


@asynccontextmanager
async def discovered(
    serve: Serve, snapshot: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> AsyncIterator[tuple[Balancer, Evidence]]:
    """A balancer under DNS discovery (see `resolve_to`) whose nodes' sidecars answer
    ``/snapshot`` with ``snapshot``, and its evidence after one discovery."""
    app = web.Application()
    app.router.add_get("/snapshot", snapshot)
    async with serve(app) as url, aiohttp.ClientSession() as session:
        port = int(url.rsplit(":", 1)[1])
        config = dns_config(name="models", port=8000, sidecar_port=port)
        lb = Balancer(config)
        evidence = Evidence(config, lb.table, session, lb.metrics)
        await evidence.discover()
        yield lb, evidence


async def test_dns_discovered_sidecars_keep_their_own_scheme() -> None:
    """Model servers behind https do not make the sidecars (plain HTTP) https too."""
    lb = Balancer(dns_config(name="127.0.0.1", port=8443, scheme="https"))
    await lb.start()
    try:
        node = lb.table.nodes["127.0.0.1:8443"]
        assert (node.config.url, node.config.sidecar) == (
            "https://127.0.0.1:8443",
            "http://127.0.0.1:9500",
        )
    finally:
        await lb.stop()


async def test_under_dns_discovery_a_sidecar_named_ip_and_port_is_taken_signed(
    launch: Launcher, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Discovery names a node IP:port (the model's port); a signed snapshot must name the node
    it is fetched for, so that is the --node-name the sidecar needs (examples/k8s passes
    $(POD_IP):8000); any other name is rejected, saying which was expected."""
    key = tmp_path / "key"
    key.write_text("k1:a-long-enough-shared-secret\n")
    model = launch("emulator", "--ttft-ms", "5")
    name = f"127.0.0.1:{model.port}"
    for node_name in (name, "model-0"):
        sidecar = launch(
            "sidecar",
            *sidecar_args(model.url, node_name, "--sign-key-file", str(key)),
        )
        config = Config(
            discovery=DiscoveryConfig(
                mode="dns",
                name="127.0.0.1",
                port=model.port,
                sidecar_port=sidecar.port,
                models=("m",),
                interval=0.2,
            ),
            sign_key_file=str(key),
            gossip_interval=0.1,
        )
        lb = Balancer(config)
        await lb.start()
        try:
            node = lb.table.nodes[name]
            deadline = time.monotonic() + 5
            while node.snapshot is None and node.snapshot_errors == 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            if node_name == name:
                assert node.snapshot is not None and node.snapshot_errors == 0
            else:
                assert node.snapshot is None
                assert f"names node 'model-0', not '{name}'" in caplog.text
        finally:
            await lb.stop()
        sidecar.stop()


async def test_an_unreachable_sidecar_keeps_the_last_view_until_it_goes_stale(
    launch: Launcher,
) -> None:
    model = launch("emulator", "--ttft-ms", "5")
    sidecar = launch(
        "sidecar",
        "--model-url",
        model.url,
        "--node-name",
        "a",
        "--no-warmup-required",
        "--sample-interval",
        "50ms",
    )
    config = Config(
        nodes=(NodeConfig(name="a", url=model.url, sidecar=sidecar.url),),
        gossip_interval=0.1,
        stale_after=1.5,  # well over how long stopping the sidecar may take on a busy machine
        health=HealthConfig(use_sidecar=False, interval=0.2),
    )
    lb = Balancer(config)
    await lb.start()
    try:
        node = lb.table.nodes["a"]
        await asyncio.sleep(0.3)
        assert node.view.snapshot is not None
        sidecar.stop()
        await asyncio.sleep(0.1)
        assert node.view.snapshot is not None  # the last good view, still fresh
        await asyncio.sleep(1.6)
        assert node.view.snapshot is None  # stale: unknown load, not idle
        assert node.snapshot_errors > 0
        assert lb.table.state_of(node) == "ready"  # the model server itself is fine
    finally:
        await lb.stop()


async def test_dns_discovery_turns_addresses_into_nodes(launch: Launcher) -> None:
    model = launch("emulator", "--ttft-ms", "5", "--model", "m")
    config = Config(
        discovery=DiscoveryConfig(
            mode="dns",
            name="localhost",
            port=model.port,
            sidecar_port=None,
            models=("m",),
            interval=0.2,
        )
    )
    lb = Balancer(config)
    await lb.start()
    try:
        name = f"127.0.0.1:{model.port}"
        assert name in lb.table.nodes
        assert lb.table.state_of(lb.table.nodes[name]) == "ready"
        assert [v.name for v in lb.table.candidates("m") or ()].count(name) == 1
    finally:
        await lb.stop()


async def test_nodes_discovery_replaces_are_checked_before_they_join(launch: Launcher) -> None:
    # A reload that changes the sidecars' port replaces every node: joined unchecked, none was
    # a candidate until the next health round.
    model = launch("emulator", "--ttft-ms", "5", "--model", "m")
    discovery = DiscoveryConfig(
        mode="dns", name="127.0.0.1", port=model.port, sidecar_port=None, models=("m",)
    )
    lb = Balancer(Config(discovery=discovery))
    await lb.start()
    try:
        name = f"127.0.0.1:{model.port}"
        assert lb.table.state_of(lb.table.nodes[name]) == "ready"
        # The sidecars now on a port where none listens: the model server answers for them.
        moved = dataclasses.replace(
            lb.config, discovery=dataclasses.replace(discovery, sidecar_port=1)
        )
        assert lb._session is not None
        evidence = Evidence(moved, lb.table, lb._session, lb.metrics)
        await evidence.discover()
        node = lb.table.nodes[name]
        assert node.config.sidecar == "http://127.0.0.1:1"  # replaced ...
        assert lb.table.state_of(node) == "ready"  # ... and checked before it joined
    finally:
        await lb.stop()


async def test_a_dns_lookup_that_never_answers_is_cut_at_its_timeout(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A DNS server that stops answering must not hold up startup, a reload or the shutdown
    behind it: the lookup is bounded and the current nodes stay."""
    lb = Balancer(dns_config(name="127.0.0.1", port=8000, timeout=0.2))
    await lb.start()
    try:
        assert "127.0.0.1:8000" in lb.table.nodes
        loop = asyncio.get_running_loop()

        async def hangs(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(3600)

        monkeypatch.setattr(loop, "getaddrinfo", hangs)
        evidence = lb._evidence
        assert evidence is not None
        started = time.monotonic()
        await asyncio.wait_for(evidence.discover(), 5)  # a regression fails, not hangs
        assert time.monotonic() - started < 2.0
        assert "127.0.0.1:8000" in lb.table.nodes
        assert any("no answer in 0.2s" in r.message for r in caplog.records)
    finally:
        await lb.stop()


async def test_discovery_that_found_no_node_asks_again_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A gateway started before its Service had ready endpoints (NXDOMAIN) refused every
    # request for the whole discovery interval (30 s).
    loop = asyncio.get_running_loop()
    lookup = loop.getaddrinfo
    failing = {"on": True}

    async def getaddrinfo(*args: Any, **kwargs: Any) -> Any:
        if failing["on"]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return await lookup(*args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    lb = Balancer(dns_config(name="127.0.0.1", port=8000, interval=30.0))
    await lb.start()
    try:
        assert not lb.table.nodes
        failing["on"] = False
        for _ in range(500):  # 1 s, then 2 s: well within the interval
            if lb.table.nodes:
                break
            await asyncio.sleep(0.01)
        assert "127.0.0.1:8000" in lb.table.nodes
    finally:
        await lb.stop()


async def test_a_replayed_snapshot_is_refused_across_a_reload_and_a_leaving_node_forgotten(
    serve: Serve, snap: MakeSnapshot, tmp_path: Path
) -> None:
    # The replay check was built afresh with each reload's evidence loops: a snapshot older
    # than the one in force, still inside its window, passed it (the table then dropped it
    # unseen, neither counted nor logged as rejected). And the nodes it remembered were never
    # forgotten, one more with each name discovery ever saw.
    key_file = tmp_path / "key"
    key_file.write_text("k1:a-long-enough-shared-secret\n")
    key = load_key_file(key_file)
    served = {"seq": 2}

    async def snapshot(request: web.Request) -> web.Response:
        wire = dataclasses.replace(snap("a", seq=served["seq"]), ts=time.time())
        return web.Response(body=encode(wire, key))

    app = web.Application()
    app.router.add_get("/snapshot", snapshot)
    async with serve(app) as url:
        a = NodeConfig(name="a", url="http://127.0.0.1:9", sidecar=url)
        b = NodeConfig(name="b", url="http://127.0.0.1:9")
        settings: dict[str, Any] = {
            "sign_key_file": str(key_file),
            "health": HealthConfig(enabled=False),
        }
        lb = Balancer(Config(nodes=(a, b), **settings))
        await lb.start()

        async def reload(*nodes: NodeConfig) -> Balancer:
            new = Balancer(Config(nodes=nodes, **settings), previous=lb)
            await new.succeed(lb)
            return new

        try:
            assert lb.table.nodes["a"].snapshot.seq == 2  # type: ignore[union-attr]
            served["seq"] = 1  # an old answer, replayed
            lb = await reload(a, b)
            node = lb.table.nodes["a"]
            assert node.snapshot is not None and node.snapshot.seq == 2
            assert node.snapshot_errors == 1
            # A node replaced (its server moved, same sidecar) polls the snapshot its
            # predecessor took: no replay, but it was refused as one, and joined without it.
            served["seq"] = 2
            lb = await reload(dataclasses.replace(a, url="http://127.0.0.1:10"), b)
            node = lb.table.nodes["a"]
            assert node.snapshot is not None and node.snapshot.seq == 2
            assert node.snapshot_errors == 0
            lb = await reload(b)
            assert lb._evidence is not None and lb._evidence._freshness is not None
            assert "a" not in lb._evidence._freshness._last
        finally:
            await lb.stop()


async def test_a_snapshot_answer_past_the_size_bound_is_not_read_whole(serve: Serve) -> None:
    # A broken or hostile sidecar streamed megabytes into memory every round before the
    # decoder's own bound refused them.
    sent = {"bytes": 0}

    async def snapshot(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            for _ in range(4096):  # 64 MB, if it were all read
                await response.write(b"\0" * 16384)
                sent["bytes"] += 16384
        except (ConnectionResetError, RuntimeError):
            pass  # the gateway closed the connection
        return response

    app = web.Application()
    app.router.add_get("/snapshot", snapshot)
    async with serve(app) as url:
        config = Config(
            nodes=(NodeConfig(name="a", url="http://127.0.0.1:9", sidecar=url),),
            health=HealthConfig(enabled=False),
        )
        lb = Balancer(config)
        await lb.start()
        try:
            node = lb.table.nodes["a"]
            assert node.snapshot is None and node.snapshot_errors == 1
        finally:
            await lb.stop()
    assert sent["bytes"] < 16 * 1024 * 1024


async def test_a_sidecar_back_with_the_snapshot_it_had_ends_its_problem(
    serve: Serve, snap: MakeSnapshot, caplog: pytest.LogCaptureFixture
) -> None:
    # Its same seq again returned before the problem was cleared: "ok again" never came, and
    # the same failure later went untold.
    failing = {"now": False}
    body = encode(snap("a", 7, running=1))

    async def snapshot(request: web.Request) -> web.Response:
        if failing["now"]:
            return web.Response(status=500)
        return web.Response(body=body, content_type="application/msgpack")

    app = web.Application()
    app.router.add_get("/snapshot", snapshot)
    async with serve(app) as url:
        config = Config(
            nodes=(NodeConfig(name="a", url="http://127.0.0.1:9", sidecar=url),),
            health=HealthConfig(enabled=False),
            gossip_interval=3600.0,  # rounds run here, by hand
            stale_after=7200.0,
        )
        lb = Balancer(config)
        await lb.start()
        evidence = lb._evidence
        assert evidence is not None
        try:
            with caplog.at_level(logging.INFO, logger="promptlb"):
                for down in (True, False, True, False):
                    failing["now"] = down
                    evidence._sit_out.clear()  # (the backoff's sit-out: every round polls)
                    await evidence.gossip_round(whole=True)
        finally:
            await lb.stop()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("node a:")]
    assert len(said) == 4, said
    assert ["ok again" in m for m in said] == [False, True, False, True], said


def test_a_problem_with_other_numbers_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    # A sidecar's clock off by more than stale_after: "is 6.1s old", "is 6.2s old"... each
    # round logged a warning, where a problem is logged once when it starts or changes.
    lb = Balancer(Config(nodes=(NodeConfig(name="a", url="http://127.0.0.1:9"),)))
    evidence = Evidence(lb.config, lb.table, None, lb.metrics)  # type: ignore[arg-type]
    node = lb.table.nodes["a"]
    with caplog.at_level("WARNING", logger="promptlb"):
        for age in ("6.1", "6.2", "7.9"):
            evidence._problem(node, "snapshot", f"SnapshotError: snapshot from 'a' is {age}s old")
        evidence._problem(node, "snapshot", "SnapshotError: sidecar /snapshot answered 500")
    assert len(caplog.records) == 2


async def test_a_gateway_takes_snapshots_signed_with_any_of_its_keys(
    serve: Serve, snap: MakeSnapshot, tmp_path: Path
) -> None:
    # Key rotation: sidecars move to the new key one by one while the gateways hold both.
    keys = tmp_path / "keys"
    keys.write_text("new:a-long-enough-new-secret\nold:a-long-enough-old-secret\n")
    apps = []
    for name, key in (("a", load_keys(keys)[0]), ("b", load_keys(keys)[1])):

        async def snapshot(request: web.Request, name: str = name, key: Any = key) -> web.Response:
            wire = dataclasses.replace(snap(name), ts=time.time())
            return web.Response(body=encode(wire, key))

        app = web.Application()
        app.router.add_get("/snapshot", snapshot)
        apps.append(app)
    async with serve(apps[0]) as url_a, serve(apps[1]) as url_b:
        nodes = (
            NodeConfig(name="a", url="http://127.0.0.1:9", sidecar=url_a),
            NodeConfig(name="b", url="http://127.0.0.1:9", sidecar=url_b),
        )
        config = Config(nodes=nodes, sign_key_file=str(keys), health=HealthConfig(enabled=False))
        lb = Balancer(config)
        await lb.start()
        try:
            assert {n.name: n.snapshot is not None for n in lb.table.nodes.values()} == {
                "a": True,
                "b": True,
            }
        finally:
            await lb.stop()


async def test_health_probes_that_hang_do_not_hold_back_the_snapshots(
    serve: Serve, snap: MakeSnapshot
) -> None:
    # One gate for both: in a partition, probes of unreachable nodes (two timeouts each) held
    # every slot, and the healthy nodes' snapshots went stale behind them.
    held = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        await held.wait()
        return web.json_response({"status": "ok"})

    async def snapshot(request: web.Request) -> web.Response:
        return web.Response(body=encode(dataclasses.replace(snap("a"), ts=time.time())))

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/snapshot", snapshot)
    async with serve(app) as url:
        config = Config(
            nodes=(NodeConfig(name="a", url="http://127.0.0.1:9", sidecar=url),),
            health=HealthConfig(timeout=5.0),
            gossip_concurrency=1,
        )
        lb = Balancer(config)
        async with aiohttp.ClientSession() as session:
            evidence = Evidence(config, lb.table, session, lb.metrics)
            probing = asyncio.create_task(evidence.health_round())
            try:
                await asyncio.sleep(0.1)  # the probe holds its slot
                await asyncio.wait_for(evidence.gossip_round(), 2.0)
                assert lb.table.nodes["a"].snapshot is not None
            finally:
                held.set()
                await probing


async def test_sidecars_that_hang_hold_back_no_other_nodes_snapshots(
    serve: Serve, snap: MakeSnapshot
) -> None:
    """A round waited for every poll: 32 sidecars that never answer, 4 slots and a 0.3 s
    timeout made each round 2.4 s long, and the healthy node's snapshot that old. Past the
    first failures (the hung ones then wait in slots of their own, and are asked less often),
    it is as fresh as the interval makes it, a blip of its own included."""

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)  # accepted, never answered

    samples = itertools.count(1)
    blips = {"left": 0}

    async def snapshot(request: web.Request) -> web.Response:
        if blips["left"]:
            blips["left"] -= 1
            return web.Response(status=500)
        fresh = dataclasses.replace(snap("good"), ts=time.time(), seq=next(samples))
        return web.Response(body=encode(fresh))

    app = web.Application()
    app.router.add_get("/snapshot", snapshot)
    hung = await asyncio.start_server(hang, "127.0.0.1", 0)
    stuck = f"http://127.0.0.1:{hung.sockets[0].getsockname()[1]}"
    async with hung, serve(app) as url:
        nodes = [NodeConfig(name=f"hung{i}", url=stuck, sidecar=stuck) for i in range(32)]
        nodes.append(NodeConfig(name="good", url=url, sidecar=url))
        config = Config(
            nodes=tuple(nodes),
            health=HealthConfig(enabled=False),
            gossip_concurrency=4,
            gossip_interval=0.2,
            gossip_timeout=0.3,
            stale_after=2.0,
        )
        lb = Balancer(config)
        async with aiohttp.ClientSession() as session:
            evidence = Evidence(config, lb.table, session, lb.metrics)
            await evidence.start()  # the whole first round: 2.4 s
            try:
                good = lb.table.nodes["good"]
                await asyncio.sleep(1.5)  # the hung sidecars have failed twice
                oldest = 0.0
                for _ in range(20):
                    await asyncio.sleep(0.1)
                    oldest = max(oldest, time.monotonic() - good.snapshot_at)
                assert oldest < 1.0
                # One failed poll of its own: asked again among the first, not behind the dead.
                await asyncio.sleep(1.0)  # (their second failures in: the steady state)
                blips["left"] = 1
                for _ in range(20):
                    await asyncio.sleep(0.1)
                    oldest = max(oldest, time.monotonic() - good.snapshot_at)
                assert blips["left"] == 0 and oldest < 1.2
            finally:
                await evidence.stop()
            hung.close()


async def test_a_pod_discovery_drops_takes_its_logged_problems_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under discovery a pod's address comes back with a new pod: its problem, still held for
    # the old one, was never logged again, and the entries grew with churn until a reload.
    answers = resolve_to(monkeypatch, "10.0.0.7")
    config = dns_config(name="models", port=8000, sidecar_port=None)
    lb = Balancer(config)
    evidence = Evidence(config, lb.table, None, lb.metrics)  # type: ignore[arg-type]
    await evidence.discover()
    node = lb.table.nodes["10.0.0.7:8000"]
    evidence._problem(node, "snapshot", "ClientConnectorError: refused")
    answers["now"] = ["10.0.0.8"]
    await evidence.discover()
    assert "10.0.0.7:8000" not in lb.table.nodes
    assert not [k for k in evidence._problems if k[0] == "10.0.0.7:8000"]


async def test_a_newcomer_joins_with_the_snapshot_its_check_fetched(
    monkeypatch: pytest.MonkeyPatch, serve: Serve, snap: MakeSnapshot
) -> None:
    # A node is polled before it joins the table: a round that kept only listed nodes' answers
    # dropped every newcomer's first snapshot, and it joined with its load unknown.
    async def snapshot(request: web.Request) -> web.Response:
        return web.Response(body=encode(snap("127.0.0.1:8000", running=3)))

    resolve_to(monkeypatch, "127.0.0.1")
    async with discovered(serve, snapshot) as (lb, _):
        joined = lb.table.nodes["127.0.0.1:8000"].snapshot
        assert joined is not None and joined.engine is not None and joined.engine.running == 3


async def test_a_round_still_out_when_its_pod_is_dropped_leaves_nothing_of_it_behind(
    monkeypatch: pytest.MonkeyPatch, serve: Serve
) -> None:
    # A snapshot poll answered after discovery dropped its pod (a pod terminating): its
    # problem was logged and kept for an address that may come back as another pod's.
    answered = asyncio.Event()

    async def snapshot(request: web.Request) -> web.Response:
        await answered.wait()
        return web.Response(status=500)

    answers = resolve_to(monkeypatch, "127.0.0.1")
    async with discovered(serve, snapshot) as (lb, evidence):
        polling = asyncio.create_task(evidence.gossip_round())
        await asyncio.sleep(0.1)  # the poll is out
        answers["now"] = ["127.0.0.2"]
        await evidence.discover()
        assert "127.0.0.1:8000" not in lb.table.nodes
        answered.set()
        await polling
    assert not [k for k in evidence._problems if k[0] == "127.0.0.1:8000"]


async def test_a_poll_that_raises_what_it_does_not_handle_is_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Awaited by its round, a bug was logged by the loop; run past the round, it would be
    # left to asyncio's "exception was never retrieved", if that ever came.
    config = Config(
        nodes=(NodeConfig(name="a", url="http://127.0.0.1:9", sidecar="http://127.0.0.1:9"),),
        health=HealthConfig(enabled=False),
    )
    lb = Balancer(config)

    async def _gossip(node: Any) -> None:  # (named as the poll it stands for)
        raise RuntimeError("a bug")

    async with aiohttp.ClientSession() as session:
        evidence = Evidence(config, lb.table, session, lb.metrics)
        monkeypatch.setattr(evidence, "_gossip", _gossip)
        with caplog.at_level(logging.ERROR, "promptlb.middleware"):
            await evidence.gossip_round()
            await asyncio.sleep(0)  # the done callback
        await evidence.stop()
    (record,) = [r for r in caplog.records if "failed" in r.getMessage()]
    assert record.getMessage() == "promptlb-gossip-a failed" and record.exc_info is not None


async def test_startup_waits_for_every_first_check_behind_hung_ones(serve: Serve) -> None:
    # A round now waits for its own at most a timeout: startup must not. A healthy node whose
    # first check still queued behind hung ones started as no candidate (503s), then was
    # slow-started as a newcomer when its check landed.
    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    hung = await asyncio.start_server(hang, "127.0.0.1", 0)
    stuck = f"http://127.0.0.1:{hung.sockets[0].getsockname()[1]}"
    async with hung, serve(app) as url:
        nodes = [NodeConfig(name=f"hung{i}", url=stuck) for i in range(6)]
        nodes.append(NodeConfig(name="good", url=url))
        config = Config(nodes=tuple(nodes), health=HealthConfig(timeout=0.3), gossip_concurrency=2)
        lb = Balancer(config)
        await lb.start()
        try:
            good = lb.table.nodes["good"]
            assert good.health_ok is True
            assert [v.name for v in lb.table.candidates("any") or ()] == ["good"]
            assert good.view.ramp == 1.0  # one of the starting cluster: no slow start
        finally:
            await lb.stop()
        hung.close()


async def test_a_reload_waits_for_hung_sidecars_no_longer_than_a_timeout() -> None:
    # Its rounds start with the reload: waiting for their whole first one, as the gateway's
    # first start does, held the reload (and every gossip loop) for a timeout per hung
    # sidecar over the slots: 8 x 0.3 s here.
    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    hung = await asyncio.start_server(hang, "127.0.0.1", 0)
    stuck = f"http://127.0.0.1:{hung.sockets[0].getsockname()[1]}"
    async with hung:
        nodes = tuple(NodeConfig(name=f"hung{i}", url=stuck, sidecar=stuck) for i in range(8))
        settings: dict[str, Any] = {
            "health": HealthConfig(enabled=False),
            "gossip_concurrency": 1,
            "gossip_timeout": 0.3,
            "stale_after": 2.0,
        }
        lb = Balancer(Config(nodes=nodes, **settings))
        await lb.start()  # the first start waits for the whole round: 2.4 s
        try:
            new = Balancer(Config(nodes=nodes, gossip_interval=0.5, **settings), previous=lb)
            started = time.monotonic()
            await new.succeed(lb)
            lb = new
            assert time.monotonic() - started < 1.5
        finally:
            await lb.stop()
        hung.close()


async def test_the_gossip_gate_serves_the_fewest_failures_first_and_caps_the_failing() -> None:
    gate = _Gate(4)  # a quarter: one slot for those that failed twice or more
    for _ in range(4):
        await gate.acquire(0)
    order: list[str] = []

    async def wait(failed: int, name: str) -> None:
        await gate.acquire(failed)
        order.append(name)

    names = (("dead-a", 3), ("dead-b", 2), ("healthy", 0), ("blip", 1))
    tasks = [asyncio.create_task(wait(failed, name)) for name, failed in names]
    gone = asyncio.create_task(gate.acquire(0))  # leaves while it waits: no slot lost
    await asyncio.sleep(0)
    gone.cancel()
    for _ in range(4):
        gate.release(0)
        await asyncio.sleep(0)
    assert order == ["healthy", "blip", "dead-a"]  # dead-b: a free slot, not a failing one
    gate.release(3)  # dead-a's
    await asyncio.sleep(0)
    assert order[-1] == "dead-b"
    await asyncio.gather(*tasks)
    # Among those failing, first come first served (above too): by their counts, one long dead
    # that came back waited behind every sidecar that began failing after it (26 s, a review's
    # run).
    gate = _Gate(4)
    for _ in range(4):
        await gate.acquire(0)
    order.clear()
    tasks = [asyncio.create_task(wait(failed, name)) for name, failed in (("back", 7), ("new", 2))]
    await asyncio.sleep(0)
    gate.release(0)
    await asyncio.sleep(0)
    assert order == ["back"]
    gate.release(0)
    gate.release(7)
    await asyncio.gather(*tasks)


async def test_a_reload_carries_the_failure_counts_but_those_of_replaced_nodes() -> None:
    config = Config(
        nodes=tuple(
            NodeConfig(name=n, url="http://127.0.0.1:9", sidecar=f"http://{n}:1") for n in "ab"
        ),
        health=HealthConfig(enabled=False),
    )
    lb = Balancer(config)
    async with aiohttp.ClientSession() as session:
        old = Evidence(config, lb.table, session, lb.metrics)
        old._failures.update(a=4, b=4)
        old._sit_out.update(a=3, b=3)
        new = Evidence(config, lb.table, session, lb.metrics, old)
        assert not new._failures  # a newcomer's check counts from nothing
        new._failures.update(b=1)  # ... and has counted b's failed check before it joined
        old._failures.update(gone=6)
        old._sit_out.update(gone=7)
        # b: another server now, under the same name; gone: no longer a member
        new.carry_counts(old, (["b"], ["gone"]))
        assert (new._failures, new._sit_out) == ({"a": 4, "b": 1}, {"a": 3})
