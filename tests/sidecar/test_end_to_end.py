"""The emulator and the sidecar as real processes, talking real HTTP."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from promptlb.shared import SigningKey, Snapshot, SnapshotError, decode

from tests.conftest import Launcher, Service

TOKEN = "e2e-secret-token"


def sidecar_args(model: Service, tmp_path: Path, *extra: str) -> list[str]:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    return [
        "--model-url",
        model.url,
        "--node-name",
        "node-a",
        "--token-file",
        str(token),
        "--tier",
        "heavy",
        "--tags",
        "code,chat",
        *extra,
    ]


async def get_snapshot(
    http: aiohttp.ClientSession, sidecar: Service, keys: dict[str, SigningKey] | None = None
) -> Snapshot:
    async with http.get(sidecar.url + "/snapshot") as response:
        assert response.status == 200
        assert response.content_type == "application/msgpack"
        return decode(await response.read(), keys)


async def wait_health(
    http: aiohttp.ClientSession,
    sidecar: Service,
    status: int,
    limit: float = 15.0,
    reasons: list[str] | None = None,
) -> dict[str, object]:
    """Poll /health until it answers `status` (and exactly `reasons`, when given).

    Waiting for the reasons matters right after start: until the first probe of the model
    server lands, "model server not probed yet" stands beside whatever else holds.
    """
    deadline = time.monotonic() + limit
    while True:
        async with http.get(sidecar.url + "/health") as response:
            body: dict[str, object] = await response.json()
            if response.status == status and reasons in (None, body.get("reasons")):
                return body
        assert time.monotonic() < deadline, f"/health never answered {status} {reasons}: {body}"
        await asyncio.sleep(0.05)


async def test_health_turns_ready_after_warmup(launch: Launcher, tmp_path: Path) -> None:
    model = launch("emulator", "--model", "big", "--load-time-s", "1.5", "--ttft-ms", "30")
    sidecar = launch("sidecar", *sidecar_args(model, tmp_path, "--sample-interval", "100ms"))
    async with aiohttp.ClientSession() as http:
        body = await wait_health(http, sidecar, 503)
        assert "warmup not done" in body["reasons"]  # type: ignore[operator]
        snap = await get_snapshot(http, sidecar)
        assert not snap.warm
        body = await wait_health(http, sidecar, 200)
        assert body["ready"] is True
        assert body["warmup"]["ok"] is True  # type: ignore[index]
        snap = await get_snapshot(http, sidecar)
    assert (snap.ready, snap.warm, snap.draining) == (True, True, False)
    assert snap.node == "node-a" and snap.tier == "heavy" and snap.tags == ("code", "chat")
    assert snap.models == ("big",)  # learnt from the model server's /v1/models
    assert snap.cpu is not None and snap.mem is not None
    assert snap.rss is not None and snap.rss > 0  # the emulator, found by its port
    assert snap.gpus == ()  # no GPU here, and no crash for it


async def test_snapshot_shows_the_engine_load(launch: Launcher, tmp_path: Path) -> None:
    model = launch("emulator", "--slots", "2", "--ttft-ms", "10", "--tokens-per-s", "20")
    # No warmup: its prompt would queue behind the load and blur the counts.
    sidecar = launch(
        "sidecar",
        *sidecar_args(
            model,
            tmp_path,
            "--sample-interval",
            "100ms",
            "--no-warmup-required",
            "--no-warmup-at-start",
        ),
    )
    async with aiohttp.ClientSession() as http:
        await wait_health(http, sidecar, 200)
        # The first sample may come before the engine's /metrics answered (a loaded CI
        # machine): an engine-less snapshot is what the sidecar then says, and the next
        # sample, 100 ms on, must carry it.
        idle = await get_snapshot(http, sidecar)
        deadline = time.monotonic() + 5
        while idle.engine is None:
            assert time.monotonic() < deadline, "no snapshot carried the engine's load"
            await asyncio.sleep(0.05)
            idle = await get_snapshot(http, sidecar)
        assert idle.engine.waiting == 0

        async def one() -> int:
            body = {
                "model": "emulated",
                "max_tokens": 60,
                "messages": [{"role": "user", "content": "hello"}],
            }
            async with http.post(model.url + "/v1/chat/completions", json=body) as response:
                await response.read()
                return response.status

        load = [asyncio.create_task(one()) for _ in range(6)]
        deadline = time.monotonic() + 10
        snap = idle
        while not (snap.engine and snap.engine.running == 2 and snap.engine.waiting == 4):
            assert time.monotonic() < deadline, f"load never showed: {snap.engine}"
            await asyncio.sleep(0.05)
            snap = await get_snapshot(http, sidecar)
        assert snap.engine.kv_cache is not None and snap.engine.kv_cache > 0
        assert snap.seq > idle.seq and snap.boot == idle.boot
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)


async def test_control_endpoints_need_the_token(launch: Launcher, tmp_path: Path) -> None:
    model = launch("emulator", "--ttft-ms", "5")
    sidecar = launch("sidecar", *sidecar_args(model, tmp_path, "--no-warmup-at-start"))
    async with aiohttp.ClientSession() as http:
        for path in ("/warmup", "/drain", "/undrain"):
            async with http.post(sidecar.url + path) as response:
                assert response.status == 401, path
                assert response.headers["WWW-Authenticate"] == "Bearer"
            wrong = {"Authorization": "Bearer not-the-token"}
            async with http.post(sidecar.url + path, headers=wrong) as response:
                assert response.status == 401, path
            # A token that is not UTF-8 was a 500 and a traceback, anyone's to send.
            reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n".encode()
                + b"Authorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n"
            )
            status = await reader.readline()
            writer.close()
            assert status.split()[1] == b"401", (path, status)
        # Nothing warmed it up (no token was given), so that stays the one reason once probed.
        await wait_health(http, sidecar, 503, reasons=["warmup not done"])
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(sidecar.url + "/warmup", headers=auth) as response:
            assert response.status == 200
            report = await response.json()
        assert report["ok"] is True and len(report["durations_ms"]) == 1
        await wait_health(http, sidecar, 200)
        async with http.post(sidecar.url + "/drain", headers=auth) as response:
            assert (await response.json())["draining"] is True
        body = await wait_health(http, sidecar, 503)
        assert body["reasons"] == ["draining"]
        assert (await get_snapshot(http, sidecar)).draining
        async with http.post(sidecar.url + "/undrain", headers=auth) as response:
            assert response.status == 200
        await wait_health(http, sidecar, 200)
        assert not (await get_snapshot(http, sidecar)).draining


async def test_a_dead_model_server_is_seen_within_a_few_sample_intervals(
    launch: Launcher, tmp_path: Path
) -> None:
    interval = 0.5
    model = launch("emulator", "--ttft-ms", "5")
    sidecar = launch("sidecar", *sidecar_args(model, tmp_path, "--sample-interval", "500ms"))
    async with aiohttp.ClientSession() as http:
        await wait_health(http, sidecar, 200)
        model.proc.kill()
        model.proc.wait(timeout=5)
        killed = time.monotonic()
        body = await wait_health(http, sidecar, 503, limit=5)
        seen = time.monotonic() - killed
        snap = await get_snapshot(http, sidecar)
        snapshot_seen = time.monotonic() - killed
    # Seen by the probe (refused) or by the process sampler (gone), whichever looked first.
    reasons = str(body["reasons"])
    assert "model server unreachable" in reasons or "model-server process exited" in reasons
    assert not snap.ready and not snap.warm  # a server that went away is cold when it returns
    # Two intervals here; four is the bound, for a loaded CI machine (a probe's own timeout
    # would take longer still).
    assert seen <= 4 * interval, f"/health took {seen:.2f}s"
    assert snapshot_seen <= 4 * interval, f"snapshot took {snapshot_seen:.2f}s"


async def test_signed_snapshots_verify_only_with_their_key(
    launch: Launcher, tmp_path: Path
) -> None:
    key = SigningKey("k1", b"a-long-enough-shared-secret")
    (tmp_path / "key").write_text("k1:a-long-enough-shared-secret\n")
    model = launch("emulator", "--ttft-ms", "5")
    sidecar = launch(
        "sidecar", *sidecar_args(model, tmp_path, "--sign-key-file", str(tmp_path / "key"))
    )
    async with aiohttp.ClientSession() as http:
        snap = await get_snapshot(http, sidecar, {"k1": key})
        assert snap.kid == "k1" and snap.sig is not None
        other = SigningKey("k1", b"another-shared-secret-entirely")
        with pytest.raises(SnapshotError, match="does not verify"):
            await get_snapshot(http, sidecar, {"k1": other})
        with pytest.raises(SnapshotError, match="unknown key id"):
            await get_snapshot(http, sidecar, {"k2": key})


async def test_protected_reads_and_prometheus_metrics(launch: Launcher, tmp_path: Path) -> None:
    model = launch("emulator", "--ttft-ms", "5")
    sidecar = launch("sidecar", *sidecar_args(model, tmp_path, "--protect-reads"))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as http:
        for path in ("/health", "/snapshot", "/metrics"):
            async with http.get(sidecar.url + path) as response:
                assert response.status == 401, path
        await asyncio.sleep(0.6)
        async with http.get(sidecar.url + "/metrics", headers=auth) as response:
            assert response.status == 200
            text = await response.text()
    assert "promptlb_sidecar_cpu_utilization_ratio" in text
    assert "promptlb_sidecar_engine_running_requests" in text


async def test_without_a_token_the_control_endpoints_are_closed(launch: Launcher) -> None:
    model = launch("emulator", "--ttft-ms", "5")
    sidecar = launch("sidecar", "--model-url", model.url)
    async with aiohttp.ClientSession() as http:
        async with http.post(sidecar.url + "/drain") as response:
            assert response.status == 403
            assert "no token configured" in (await response.json())["error"]
        async with http.get(sidecar.url + "/snapshot") as response:
            assert response.status == 200


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_stops_the_sidecar_promptly_with_exit_0(
    launch: Launcher, tmp_path: Path, sig: signal.Signals
) -> None:
    model = launch("emulator", "--ttft-ms", "5")
    sidecar = launch("sidecar", *sidecar_args(model, tmp_path, "--sample-interval", "50ms"))
    async with aiohttp.ClientSession() as http:
        await wait_health(http, sidecar, 200)  # collectors and warmup have run
    sent = time.monotonic()
    sidecar.proc.send_signal(sig)
    code = sidecar.proc.wait(timeout=10)
    took = time.monotonic() - sent
    assert code == 0, sidecar.log()
    assert took < 3.0, f"took {took:.2f}s to stop"
    assert "Traceback" not in sidecar.log()


async def test_each_repeated_warmup_prompt_is_sent(launch: Launcher, tmp_path: Path) -> None:
    model = launch("emulator", "--ttft-ms", "5")
    sidecar = launch(
        "sidecar",
        *sidecar_args(model, tmp_path, "--warmup-prompt", "first", "--warmup-prompt", "second"),
    )
    async with aiohttp.ClientSession() as http:
        body = await wait_health(http, sidecar, 200)
    report = body["warmup"]
    assert isinstance(report, dict) and report["ok"] is True
    assert len(report["durations_ms"]) == 2


async def test_models_given_on_the_command_line_override_the_learnt_ones(
    launch: Launcher, tmp_path: Path
) -> None:
    model = launch("emulator", "--model", "big", "--model", "small", "--ttft-ms", "5")
    sidecar = launch("sidecar", *sidecar_args(model, tmp_path, "--models", "small"))
    async with aiohttp.ClientSession() as http:
        await wait_health(http, sidecar, 200)  # warmed up on "small", which the server has
        snap = await get_snapshot(http, sidecar)
    assert snap.models == ("small",)  # not ("big", "small") from /v1/models
