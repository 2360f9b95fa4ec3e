"""The sidecar app in process, against a model server whose /metrics the test controls."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from promptlb.shared import (
    EPOCHS_V,
    SEQ_EPOCH_BITS,
    ConfigError,
    EngineSample,
    GpuSample,
    Snapshot,
    decode,
)
from promptlb.sidecar import EngineReading, SidecarConfig, create_app
from promptlb.sidecar import _app as sidecar_app
from promptlb.sidecar import _names as sidecar_names
from promptlb.sidecar._app import LIVE, _Collectors
from promptlb.sidecar._gpu import GpuCollector
from promptlb.sidecar._host import HostCollector
from promptlb.sidecar._live import Live
from promptlb.sidecar._model_server import WarmupReport

from tests.conftest import Serve
from tests.sidecar.conftest import FakeNvml

GOOD = "vllm:num_requests_running 3\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\n"


async def test_malformed_engine_metrics_drop_the_engine_fields_and_log_once_per_change(
    caplog: pytest.LogCaptureFixture, serve: Serve
) -> None:
    metrics = {"text": GOOD}

    async def handler(request: web.Request) -> web.Response:
        if request.path == "/metrics":
            return web.Response(text=metrics["text"])
        return web.json_response({"status": "ok"})

    model = web.Application()
    model.router.add_get("/{tail:.*}", handler)
    async with AsyncExitStack() as stack:
        model_url = await stack.enter_async_context(serve(model))
        config = SidecarConfig(
            model_url=model_url,
            node_name="n",
            sample_interval_s=0.02,
            warmup_at_start=False,
            warmup_required=False,
            gpu=False,
        )
        sidecar = create_app(config)
        await stack.enter_async_context(serve(sidecar))
        live = sidecar[LIVE]

        async def engine_after(text: str) -> Snapshot:
            metrics["text"] = text
            await asyncio.sleep(0.2)  # ten sample intervals
            return decode(live.encoded())

        with caplog.at_level(logging.INFO, "promptlb.sidecar"):
            assert (await engine_after(GOOD)).engine is not None
            assert (await engine_after("vllm:num_requests_running {{{\n")).engine is None
            assert (await engine_after("tgi_queue_size 2\n")).engine is None
            good = await engine_after(GOOD)
            assert good.engine is not None and good.engine.running == 3
    messages = [r.getMessage() for r in caplog.records if "engine metrics" in r.getMessage()]
    # One line per change: two different problems, then the recovery; never one per sample.
    assert len(messages) == 3, messages
    assert "does not parse" in messages[0] and "no running gauge" not in messages[0]
    assert "ok again" in messages[2]


async def test_a_snapshot_is_encoded_once_per_change() -> None:
    config = SidecarConfig(model_url="http://127.0.0.1:9", node_name="n", gpu=False)
    live = create_app(config)[LIVE]
    first = live.encoded()
    assert live.encoded() is first  # nothing changed: the same bytes, no new seq
    live.draining = True
    live.changed()
    second = decode(live.encoded())
    assert second.seq == decode(first).seq + 1 and second.draining
    assert abs(second.ts - time.time()) < 5


# --- a controllable model server, and a sidecar in process beside it ------------------------------

# A route's answer, or a coroutine of one (an answer that takes its time).
Reply = Callable[[web.Request], web.StreamResponse | Awaitable[web.StreamResponse]]
SidecarBeside = Callable[..., AbstractAsyncContextManager[tuple[web.Application, Live]]]


@pytest.fixture
def sidecar_beside(serve: Serve) -> SidecarBeside:
    """``async with sidecar_beside(routes, **overrides) as (app, live):`` a model server
    answering ``routes`` (path -> reply; others 404) and a sidecar for it."""

    @asynccontextmanager
    async def beside(
        routes: dict[str, Reply], **overrides: Any
    ) -> AsyncIterator[tuple[web.Application, Live]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            reply = routes.get(request.path)
            if reply is None:
                return web.Response(status=404)
            answer = reply(request)
            return await answer if inspect.isawaitable(answer) else answer

        model = web.Application()
        model.router.add_route("*", "/{tail:.*}", handler)
        async with serve(model) as model_url:
            settings: dict[str, Any] = {
                "model_url": model_url,
                "node_name": "n",
                "sample_interval_s": 0.02,
                "warmup_at_start": False,
                "warmup_required": False,
                "gpu": False,
                **overrides,
            }
            sidecar = create_app(SidecarConfig(**settings))
            async with serve(sidecar):
                yield sidecar, sidecar[LIVE]

    return beside


async def until(condition: Callable[[], object], limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


def text(body: str, status: int = 200) -> Reply:
    return lambda request: web.Response(text=body, status=status)


def models_reply(*names: str) -> Reply:
    return lambda request: web.json_response({"data": [{"id": n} for n in names]})


def changing_metrics(first: str) -> tuple[dict[str, Reply], dict[str, str]]:
    """Routes of a model server whose /metrics answers ``metrics["text"]``, ``first`` at
    first: the test changes it as it goes."""
    metrics = {"text": first}
    routes: dict[str, Reply] = {
        "/health": text("ok"),
        "/metrics": lambda request: web.Response(text=metrics["text"]),
    }
    return routes, metrics


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info]


async def test_a_model_server_that_asks_for_a_key_is_sent_it_on_every_call(
    sidecar_beside: SidecarBeside,
) -> None:
    # vLLM with --api-key: its /v1 routes answer 401 without it, and the node never warmed.
    key = "sk-model-server-key"
    seen: list[str | None] = []

    def guarded(reply: Reply) -> Reply:
        def answer(request: web.Request) -> web.StreamResponse | Awaitable[web.StreamResponse]:
            seen.append(request.headers.get("Authorization"))
            if request.headers.get("Authorization") != f"Bearer {key}":
                return web.json_response({"error": "unauthorised"}, status=401)
            return reply(request)

        return answer

    routes: dict[str, Reply] = {
        "/health": text("ok"),
        "/v1/models": guarded(models_reply("m")),
        "/v1/chat/completions": guarded(lambda request: web.json_response({"choices": []})),
    }
    settings = {"warmup_at_start": True, "warmup_required": True, "engine": "none"}
    async with sidecar_beside(routes, **settings) as (_, live):
        await until(lambda: live.warmup is not None)
        assert not live.ready and live.warmup is not None and "401" in live.warmup.error
    seen.clear()
    async with sidecar_beside(routes, model_api_key=key, **settings) as (_, live):
        await until(lambda: live.ready)
        assert decode(live.encoded()).models == ("m",)
    assert seen and set(seen) == {f"Bearer {key}"}


async def test_a_warmup_that_raises_is_tried_again(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, sidecar_beside: SidecarBeside
) -> None:
    # Unguarded, the warmup task ended at its first exception, silently, and the node (or a
    # restarted server) was never warmed again.
    real = sidecar_app.run_warmup
    calls = {"n": 0}

    async def flaky(app: web.Application) -> WarmupReport:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug")
        return await real(app)

    monkeypatch.setattr(sidecar_app, "run_warmup", flaky)
    routes: dict[str, Reply] = {
        "/health": text("ok"),
        "/v1/models": models_reply("m"),
        "/v1/chat/completions": lambda request: web.json_response({"choices": []}),
    }
    settings = {"warmup_at_start": True, "warmup_required": True, "engine": "none"}
    with caplog.at_level(logging.WARNING, "promptlb.sidecar"):
        async with sidecar_beside(routes, **settings) as (_, live):
            await until(lambda: live.ready)
    assert calls["n"] >= 2
    assert [m for m in tracebacks(caplog) if "warmup failed" in m] == ["warmup failed"]


def test_a_card_without_utilisation_exports_its_memory_and_no_utilisation() -> None:
    # A card in MIG mode reads util None: add_metric(None) failed every scrape of /metrics.
    live = Live(SidecarConfig(node_name="n"))
    live.gpus = (GpuSample(0, None, 1_000, 80_000), GpuSample(1, 0.5, 2_000, 80_000))
    samples = {
        (s.name, s.labels.get("gpu")): s.value
        for family in sidecar_app._LiveMetrics(live).collect()
        for s in family.samples
    }
    assert samples[("promptlb_sidecar_gpu_utilization_ratio", "1")] == 0.5
    assert ("promptlb_sidecar_gpu_utilization_ratio", "0") not in samples
    assert samples[("promptlb_sidecar_gpu_memory_used_bytes", "0")] == 1_000 * 1024 * 1024


def test_a_card_without_a_memory_reading_exports_no_memory() -> None:
    # A unified-memory board reads 0 of 0: exported, every used/total panel read NaN.
    live = Live(SidecarConfig(node_name="n"))
    live.gpus = (GpuSample(0, 0.5, 0, 0), GpuSample(1, 0.5, 2_000, 80_000))
    names = {
        (s.name, s.labels.get("gpu"))
        for family in sidecar_app._LiveMetrics(live).collect()
        for s in family.samples
    }
    assert ("promptlb_sidecar_gpu_memory_total_bytes", "0") not in names
    assert ("promptlb_sidecar_gpu_memory_total_bytes", "1") in names
    assert ("promptlb_sidecar_gpu_utilization_ratio", "0") in names


async def test_a_warmup_refused_again_and_again_is_told_once(
    caplog: pytest.LogCaptureFixture, sidecar_beside: SidecarBeside
) -> None:
    # Retried with backoff, each refusal was a warning of its own, forever.
    tries: list[int] = []

    def refuse(request: web.Request) -> web.StreamResponse:
        tries.append(1)
        return web.json_response({"error": "no such route"}, status=404)

    routes: dict[str, Reply] = {
        "/health": text("ok"),
        "/v1/models": models_reply("m"),
        "/v1/chat/completions": refuse,
    }
    settings = {"warmup_at_start": True, "warmup_required": False, "engine": "none"}
    with caplog.at_level(logging.INFO, "promptlb.sidecar"):
        async with sidecar_beside(routes, **settings) as (_, live):
            await until(lambda: len(tries) >= 3, limit=10)
            assert live.ready and not live.warm  # unrequired: it serves cold meanwhile
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warmup")]
    assert len(said) == 1 and "404" in said[0], said


# --- learnt model names ---------------------------------------------------------------------------


async def test_a_model_list_nested_past_the_parsers_depth_is_no_list_and_no_traceback(
    caplog: pytest.LogCaptureFixture, sidecar_beside: SidecarBeside
) -> None:
    deep = '{"data": ' + "[" * 100_000 + "]" * 100_000 + "}"
    routes = {"/health": text("ok"), "/v1/models": text(deep)}
    with caplog.at_level(logging.INFO, "promptlb.sidecar"):
        async with sidecar_beside(routes) as (_, live):
            # The probe learns names before the server reads as up: it raised there, for good.
            await until(lambda: live.server_ok)
            assert live.models == ()
    assert not tracebacks(caplog)


async def test_learnt_model_names_that_break_the_limits_are_left_out_and_logged_once(
    caplog: pytest.LogCaptureFixture,
    sidecar_beside: SidecarBeside,
) -> None:
    path = "/mnt/models/" + "meta-llama/Llama-3.1-70B-Instruct/".ljust(200, "x")  # 212 chars
    # Over 256 characters, empty, and a lone surrogate (valid JSON, but msgpack cannot pack it).
    names = (path, "y" * 300, "", "bad\ud800", *(f"m{i}" for i in range(70)))
    routes = {"/health": text("ok"), "/v1/models": models_reply(*names)}
    with caplog.at_level(logging.INFO, "promptlb.sidecar"):
        async with sidecar_beside(routes) as (_, live):
            await until(lambda: live.models)
            await asyncio.sleep(0.2)  # ten probes more
            snap = decode(live.encoded())
    # vLLM's model id is often a long path: up to 256 characters fit; 64 names in all.
    assert snap.models == (path, *(f"m{i}" for i in range(63)))
    warnings = [r.getMessage() for r in caplog.records if "model names" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "3 empty, unencodable or over 256 characters" in warnings[0]
    assert "7 beyond the first 64" in warnings[0]
    assert not tracebacks(caplog)


async def test_learnt_names_are_kept_within_the_room_the_configured_tags_leave(
    caplog: pytest.LogCaptureFixture, sidecar_beside: SidecarBeside
) -> None:
    # Tags of ~30 KiB (accepted) and 64 learnt names of 256 two-byte characters: together over
    # the snapshot's 64 KiB, and every /snapshot was a 500.
    tags = tuple(f"{i:02}" + "é" * 254 for i in range(60))
    names = tuple(f"{i:02}" + "é" * 254 for i in range(64))
    routes = {"/health": text("ok"), "/v1/models": models_reply(*names)}
    with caplog.at_level(logging.INFO, "promptlb.sidecar"):
        async with sidecar_beside(routes, tags=tags, engine="none") as (_, live):
            await until(lambda: live.models)
            snap = decode(live.encoded())  # encodes: no SnapshotError
    assert 0 < len(snap.models) < 64 and snap.models == names[: len(snap.models)]
    assert any("beyond the snapshot's room" in r.getMessage() for r in caplog.records)


async def test_configured_models_override_the_learnt_ones(sidecar_beside: SidecarBeside) -> None:
    routes = {"/health": text("ok"), "/v1/models": models_reply("learnt")}
    async with sidecar_beside(routes, models=("a", "b")) as (_, live):
        await until(lambda: live.server_ok)
        await asyncio.sleep(0.1)
        assert decode(live.encoded()).models == ("a", "b")


async def test_model_names_are_asked_again_until_v1_models_answers(
    sidecar_beside: SidecarBeside,
) -> None:
    """/v1/models failing as the server comes up must not leave the node without names: the
    gateway would send it every model's traffic."""
    asked = {"times": 0}
    failing = {"now": True}

    def flaky(request: web.Request) -> web.StreamResponse:
        asked["times"] += 1
        if failing["now"]:
            return web.Response(status=503, text="loading")
        return web.json_response({"data": [{"id": "real"}]})

    routes = {"/health": text("ok"), "/v1/models": flaky}
    async with sidecar_beside(routes) as (_, live):
        await until(lambda: live.server_ok)
        await asyncio.sleep(0.5)  # 25 probes
        assert live.models == () and 3 <= asked["times"] <= 8  # asked again, backing off
        failing["now"] = False
        await until(lambda: live.models)
        snap = decode(live.encoded())
        assert snap.ready and snap.warm and snap.models == ("real",)
        settled = asked["times"]
        await asyncio.sleep(0.3)  # fifteen probes more
        assert asked["times"] == settled  # known: not asked at every probe


async def test_model_names_are_refreshed_and_a_failed_refresh_keeps_them(
    monkeypatch: pytest.MonkeyPatch, sidecar_beside: SidecarBeside
) -> None:
    monkeypatch.setattr(sidecar_names, "_MODELS_REFRESH_S", 0.05)
    models = {"reply": models_reply("a")}
    routes: dict[str, Reply] = {
        "/health": text("ok"),
        "/v1/models": lambda request: models["reply"](request),
    }
    async with sidecar_beside(routes) as (_, live):
        await until(lambda: live.models == ("a",))
        models["reply"] = text("overloaded", 503)
        await asyncio.sleep(0.3)  # several refreshes fail
        assert decode(live.encoded()).models == ("a",)  # never none: that is any model
        models["reply"] = models_reply("b")  # the model was swapped on the running server
        await until(lambda: live.models == ("b",))


async def test_model_names_the_warmup_learns_are_kept(sidecar_beside: SidecarBeside) -> None:
    # /health fails, so the probe asks nothing: only the warmup's own request learns names.
    routes = {
        "/health": text("loading", 503),
        "/v1/models": models_reply("real"),
        "/v1/chat/completions": text("{}"),
    }
    async with sidecar_beside(routes) as (app, live):
        report = await sidecar_app.run_warmup(app)
        assert report.ok
        assert decode(live.encoded()).models == ("real",)


@pytest.mark.parametrize(
    ("endpoint", "path", "field"),
    [
        ("embeddings", "/v1/embeddings", "input"),
        ("completions", "/v1/completions", "prompt"),
        ("chat", "/v1/chat/completions", "messages"),
    ],
)
async def test_the_warmup_goes_through_the_api_the_server_has(
    sidecar_beside: SidecarBeside, endpoint: str, path: str, field: str
) -> None:
    """An embeddings server has no chat route: every warmup answered 404 and the node never
    became ready. The endpoint is chosen (``--warmup-endpoint``), the body shaped for it."""
    seen: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"object": "list", "data": []})

    routes: dict[str, Reply] = {
        "/health": text("ok"),
        "/v1/models": models_reply("m"),
        path: answer,
    }
    async with sidecar_beside(routes, warmup_endpoint=endpoint) as (app, _):
        report = await sidecar_app.run_warmup(app)
    assert report.ok, report.error
    assert seen and seen[0]["model"] == "m" and field in seen[0]
    assert ("max_tokens" in seen[0]) == (endpoint != "embeddings")


def test_a_warmup_endpoint_the_sidecar_does_not_know_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="warmup_endpoint"):
        SidecarConfig(model_url="http://m:1", node_name="n", warmup_endpoint="rerank")  # type: ignore[arg-type]


# --- readiness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [404, 405])
async def test_a_server_without_health_is_probed_on_v1_models(
    status: int, sidecar_beside: SidecarBeside
) -> None:
    models = {"reply": models_reply("m")}
    routes: dict[str, Reply] = {
        "/health": text("no such route", status),
        "/v1/models": lambda request: models["reply"](request),
    }
    async with sidecar_beside(routes) as (_, live):
        await until(lambda: live.server_ok)
        snap = decode(live.encoded())
        assert snap.ready and snap.models == ("m",)
        models["reply"] = text("loading", 503)
        await until(lambda: not live.server_ok)
        assert live.reasons() == ["model server /v1/models answered 503"]


async def test_the_server_reads_as_up_only_once_its_model_names_are_learnt(
    sidecar_beside: SidecarBeside,
) -> None:
    # A ready snapshot naming no model makes the node one that takes any model at the
    # gateways: while /v1/models is still answering, the server is not up yet.
    async def slow_models(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)
        return web.json_response({"data": [{"id": "m"}]})

    routes: dict[str, Reply] = {"/health": text("ok"), "/v1/models": slow_models}
    async with sidecar_beside(routes) as (_, live):
        await until(lambda: live.server_ok)
        assert decode(live.encoded()).models == ("m",)


async def test_a_health_error_other_than_404_or_405_is_not_ready(
    sidecar_beside: SidecarBeside,
) -> None:
    routes = {"/health": text("boom", 500), "/v1/models": models_reply("m")}
    async with sidecar_beside(routes) as (_, live):
        await until(lambda: live.server_reason != "model server not probed yet")
        assert not live.server_ok
        assert live.server_reason == "model server /health answered 500"


async def test_one_failed_probe_of_a_ready_server_is_not_enough_to_make_it_unready(
    sidecar_beside: SidecarBeside,
) -> None:
    health = {"fail": 0}
    seen = {"failed": 0}

    def answer(request: web.Request) -> web.Response:
        if health["fail"]:
            health["fail"] -= 1
            seen["failed"] += 1
            return web.Response(text="busy", status=500)
        return web.Response(text="ok")

    routes = {"/health": answer, "/v1/models": models_reply("m")}
    async with sidecar_beside(routes, unhealthy_after=2) as (_, live):
        await until(lambda: live.server_ok)
        flips: list[bool] = []
        health["fail"] = 1  # one late or failed answer: a busy server
        while seen["failed"] < 1:
            flips.append(live.server_ok)
            await asyncio.sleep(0.005)
        for _ in range(10):  # a few probes more
            flips.append(live.server_ok)
            await asyncio.sleep(0.01)
        assert all(flips)
        health["fail"] = 1000  # failing for good: unready after two in a row
        await until(lambda: not live.server_ok)
        assert live.server_reason == "model server /health answered 500"
        assert seen["failed"] >= 3


# --- engine readings out of range -----------------------------------------------------------------


async def test_an_out_of_range_engine_count_drops_the_engine_and_logs_once(
    caplog: pytest.LogCaptureFixture,
    sidecar_beside: SidecarBeside,
) -> None:
    routes, metrics = changing_metrics(GOOD)
    with caplog.at_level(logging.INFO, "promptlb.sidecar"):
        async with sidecar_beside(routes) as (_, live):
            await until(lambda: live.engine is not None)
            metrics["text"] = "vllm:num_requests_running 1e30\nvllm:num_requests_waiting 0\n"
            await until(lambda: live.engine is None)
            await asyncio.sleep(0.2)  # ten scrapes more
            assert decode(live.encoded()).engine is None
            metrics["text"] = GOOD
            await until(lambda: live.engine is not None)
    messages = [r.getMessage() for r in caplog.records if "engine metrics" in r.getMessage()]
    assert len(messages) == 2, messages
    assert "running = 1e+30" in messages[0] and "ok again" in messages[1]
    assert not tracebacks(caplog)


async def test_an_engine_reading_stands_through_fewer_failed_scrapes_than_unhealthy_after(
    sidecar_beside: SidecarBeside,
) -> None:
    hang = {"left": 0}  # scrapes still to hang past the timeout

    async def metrics(request: web.Request) -> web.Response:
        if hang["left"] > 0:
            hang["left"] -= 1
            await asyncio.sleep(1.0)
        return web.Response(text=GOOD)

    routes: dict[str, Reply] = {"/health": text("ok"), "/metrics": metrics}
    async with sidecar_beside(routes, probe_timeout_s=0.1, unhealthy_after=3) as (_, live):
        await until(lambda: live.engine is not None)
        hang["left"] = 2  # under unhealthy_after: a busy engine late twice keeps its queue
        deadline = time.monotonic() + 0.6
        held = 0  # the kept reading's age as snapshots tell it: readers learn when it was read
        seqs: list[int] = []  # ... and, by the seq's epoch, which reading: the same, sent again
        kept: set[int] = set()  # the seqs that carried the kept reading
        while time.monotonic() < deadline:
            assert live.engine is not None and live.engine.running == 3
            snapshot = decode(live.encoded())
            engine = snapshot.engine
            assert engine is not None and snapshot.v == EPOCHS_V
            held = max(held, engine.age_ms)
            seqs.append(snapshot.seq)
            if engine.age_ms >= 150:
                kept.add(snapshot.seq)
            await asyncio.sleep(0.01)
        assert hang["left"] == 0  # both late scrapes happened meanwhile
        assert held >= 150  # two scrapes of 0.1 s each failed in a row
        assert seqs == sorted(seqs), seqs
        epochs = {seq >> SEQ_EPOCH_BITS for seq in kept}
        # One reading kept through both late scrapes, in one epoch, with the other collectors'
        # news (new seqs) meanwhile; and new readings before and after it, new epochs.
        assert len(epochs) == 1 and len(kept) >= 2, kept
        assert len({seq >> SEQ_EPOCH_BITS for seq in seqs}) >= 2, seqs
        await until(lambda: decode(live.encoded()).engine.age_ms < held)  # type: ignore[union-attr]
        assert decode(live.encoded()).seq >> SEQ_EPOCH_BITS > epochs.pop()  # a new one since
        hang["left"] = 1_000  # late for good: unknown after unhealthy_after, as before
        await until(lambda: live.engine is None)
        hang["left"] = 0
        await until(lambda: live.engine is not None)


async def test_a_token_counter_leaping_out_of_range_leaves_tps_out(
    caplog: pytest.LogCaptureFixture,
    sidecar_beside: SidecarBeside,
) -> None:
    load = (
        "vllm:num_requests_running {}\nvllm:num_requests_waiting 0\n"
        "# TYPE vllm:generation_tokens_total counter\n"
    )
    routes, metrics = changing_metrics(load.format(1) + "vllm:generation_tokens_total 0\n")
    with caplog.at_level(logging.INFO, "promptlb.sidecar"):
        async with sidecar_beside(routes) as (_, live):
            await until(lambda: live.engine is not None)
            await asyncio.sleep(0.1)
            assert live.engine is not None and live.engine.tps == 0.0  # the counter is read
            metrics["text"] = load.format(5) + "vllm:generation_tokens_total 1e30\n"
            await until(lambda: live.engine is not None and live.engine.running == 5)
            assert live.engine is not None and live.engine.tps is None
            metrics["text"] = load.format(6) + "vllm:generation_tokens_total 1e30\n"
            await until(lambda: live.engine is not None and live.engine.running == 6)
            assert live.engine is not None and live.engine.tps == 0.0  # no growth: a real rate
    assert not tracebacks(caplog)


async def test_an_engine_whose_counter_moves_as_requests_end_reports_no_burst(
    monkeypatch: pytest.MonkeyPatch, sidecar_beside: SidecarBeside
) -> None:
    # llama.cpp counts an answer's tokens when it ends: one scrape interval's rate was a burst
    # of the whole answer, which the gateways took for the node's speed. Its rate comes over
    # the window (30 s; 0.5 s here).
    monkeypatch.setattr(sidecar_app, "END_COUNTER_WINDOW_S", 0.5)
    load = (
        "llamacpp:requests_processing {}\nllamacpp:requests_deferred 0\n"
        "# TYPE llamacpp:tokens_predicted_total counter\n"
    )
    routes, metrics = changing_metrics(load.format(1) + "llamacpp:tokens_predicted_total 0\n")
    async with sidecar_beside(routes) as (_, live):
        await until(lambda: live.engine is not None)
        metrics["text"] = load.format(2) + "llamacpp:tokens_predicted_total 1000\n"
        await until(lambda: live.engine is not None and live.engine.running == 2)
        seen = []
        for _ in range(10):  # the reading with the jump (1,000 over 0.02 s), and those after
            assert live.engine is not None
            seen.append(live.engine.tps)
            await asyncio.sleep(0.02)
        assert seen == [None] * 10, seen
        # Answers of 100 tokens ending every 50 ms (2,000 tokens/s) for a second: once the
        # readings span the window, that rate, not a reading's burst of 5,000 or 0.
        total, rates = 1000, []
        for _ in range(20):
            total += 100
            metrics["text"] = load.format(2) + f"llamacpp:tokens_predicted_total {total}\n"
            await asyncio.sleep(0.05)
            assert live.engine is not None
            rates.append(live.engine.tps)
        late = [r for r in rates[-6:] if r is not None]
        assert late and all(500 <= r <= 3000 for r in late), rates  # (room for a slow machine)


async def test_an_engines_own_throughput_gauge_is_its_tps(sidecar_beside: SidecarBeside) -> None:
    metrics = (
        "sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\nsglang:gen_throughput 96.5\n"
        "# TYPE sglang:generation_tokens counter\nsglang:generation_tokens_total 1e6\n"
    )
    routes: dict[str, Reply] = {"/health": text("ok"), "/metrics": text(metrics)}
    async with sidecar_beside(routes) as (_, live):
        await until(lambda: live.engine is not None)
        assert live.engine is not None and live.engine.tps == 96.5
        sent = decode(live.encoded()).engine  # as read, stamped with its age
        assert sent is not None and dataclasses.replace(sent, age_ms=0) == live.engine


async def test_an_engine_sample_the_snapshot_refuses_is_dropped_and_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, sidecar_beside: SidecarBeside
) -> None:
    # Whatever slips past the parser, the snapshot's own checks must not become a traceback.
    def parse(text: str, engine: str) -> EngineReading:
        return EngineReading("vllm", 2**60, 0, None, None)

    monkeypatch.setattr(sidecar_app, "parse_engine_metrics", parse)
    routes = {"/health": text("ok"), "/metrics": text(GOOD)}
    with caplog.at_level(logging.INFO, "promptlb.sidecar"):
        async with sidecar_beside(routes) as (_, live):
            live.engine = EngineSample(running=1, waiting=0)  # must not outlive the problem
            await until(lambda: live.engine is None)
            await asyncio.sleep(0.2)
            assert decode(live.encoded()).engine is None
    messages = [r.getMessage() for r in caplog.records if "engine metrics" in r.getMessage()]
    assert len(messages) == 1 and "engine.running" in messages[0], messages
    assert not tracebacks(caplog)


# --- host and GPU sampling ------------------------------------------------------------------------


def sample_gpus_from(
    monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml, within: float | None = None
) -> None:
    """Sidecars built from now on read ``nvml``, each GPU sample given ``within`` seconds."""
    if within is not None:
        monkeypatch.setattr(sidecar_app, "GPU_SAMPLE_S", within)
    monkeypatch.setattr(sidecar_app, "GpuCollector", lambda **kwargs: GpuCollector(nvml, **kwargs))


async def test_gpus_are_sampled_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml, sidecar_beside: SidecarBeside
) -> None:
    threads: set[int] = set()
    utilisation = nvml.nvmlDeviceGetUtilizationRates

    def traced(h: int) -> Any:
        threads.add(threading.get_ident())
        return utilisation(h)

    monkeypatch.setattr(nvml, "nvmlDeviceGetUtilizationRates", traced)
    sample_gpus_from(monkeypatch, nvml)
    async with sidecar_beside({"/health": text("ok")}, gpu=True) as (_, live):
        await until(lambda: live.gpus)
        assert [g.i for g in decode(live.encoded()).gpus] == [0, 1]
    assert threads and threading.get_ident() not in threads
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


async def test_a_hung_gpu_leaves_the_gpus_out_and_the_host_readings_going(
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    nvml: FakeNvml,
    sidecar_beside: SidecarBeside,
) -> None:
    # A GPU fallen off the bus can block an NVML call for good: sampled with the host in one
    # call, the CPU and memory readings froze too, served as fresh.
    released = threading.Event()
    hung = {"on": False}
    utilisation = nvml.nvmlDeviceGetUtilizationRates

    def maybe_hang(h: int) -> Any:
        if hung["on"]:
            released.wait(10)
        return utilisation(h)

    monkeypatch.setattr(nvml, "nvmlDeviceGetUtilizationRates", maybe_hang)
    sample_gpus_from(monkeypatch, nvml, within=0.2)
    hosts: list[object] = []
    with caplog.at_level(logging.WARNING, "promptlb.sidecar"):
        async with sidecar_beside({"/health": text("ok")}, gpu=True) as (_, live):
            try:
                await until(lambda: live.gpus)
                hung["on"] = True
                await until(lambda: not live.gpus)
                monkeypatch.setattr(HostCollector, "sample", lambda self: (len(hosts) / 100, 0.5))
                for _ in range(5):
                    hosts.append(live.host)
                    await asyncio.sleep(0.1)
                assert len(set(hosts)) > 1  # the host is still read while the GPU hangs
                assert decode(live.encoded()).gpus == ()
            finally:
                hung["on"] = False
                released.set()
            await until(lambda: live.gpus)
    assert any("NVML has not answered" in r.getMessage() for r in caplog.records)


async def test_a_sidecar_whose_nvml_hangs_at_start_still_serves_and_stops(
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    nvml: FakeNvml,
    sidecar_beside: SidecarBeside,
) -> None:
    # NVML started on the way up, outside the samples' time limit: a GPU off the bus kept the
    # sidecar from ever listening (and SIGTERM from stopping it).
    released = threading.Event()
    init = nvml.nvmlInit

    def hang() -> None:
        released.wait(10)
        init()

    monkeypatch.setattr(nvml, "nvmlInit", hang)
    sample_gpus_from(monkeypatch, nvml, within=0.2)
    try:
        with caplog.at_level(logging.WARNING, "promptlb.sidecar"):
            async with asyncio.timeout(15):  # startup hung for good; shutdown waits 2 s
                async with sidecar_beside({"/health": text("ok")}, gpu=True) as (_, live):
                    await until(lambda: live.host is not None and live.server_ok)
                    assert live.gpus == ()
                    await until(
                        lambda: any(
                            "NVML has not answered" in r.getMessage() for r in caplog.records
                        )
                    )
    finally:
        released.set()


def test_closing_does_not_wait_for_good_on_a_hung_sample(
    monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml
) -> None:
    from promptlb.sidecar import _gpu

    monkeypatch.setattr(_gpu, "CLOSE_WAIT_S", 0.1)
    collector = GpuCollector(nvml, enabled=True)
    collector.open()
    collector._lock.acquire()  # as a sample stuck in NVML holds it
    try:
        started = time.monotonic()
        collector.close()
        assert time.monotonic() - started < 2
    finally:
        collector._lock.release()
    collector.close()
    assert nvml.shutdowns == 1


# --- the model-server process ---------------------------------------------------------------------


async def test_a_replaced_model_server_process_makes_the_node_cold(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(SidecarConfig(model_url="http://127.0.0.1:9", node_name="n", gpu=False))
    collectors = _Collectors(app)
    live = collectors.live
    process = collectors.process
    replaced = {"now": False}

    def sample(now: float | None = None) -> tuple[int | None, float | None]:
        process.reason, process.restarted = "", replaced["now"]
        return (1 << 30, None)

    monkeypatch.setattr(process, "sample", sample)
    live.warm = True
    await collectors.sample_process()
    assert live.warm and live.rss == 1 << 30
    replaced["now"] = True
    with caplog.at_level(logging.WARNING, "promptlb.sidecar"):
        await collectors.sample_process()
    assert not live.warm
    assert "warmup will run again" in caplog.text


async def test_a_model_server_process_seen_gone_is_not_ok_until_the_probe_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = create_app(SidecarConfig(model_url="http://127.0.0.1:9", node_name="n", gpu=False))
    collectors = _Collectors(app)
    live = collectors.live
    process = collectors.process

    def gone(now: float | None = None) -> tuple[int | None, float | None]:
        process.reason, process.restarted = "no process listens on port 9", True
        return (None, None)

    monkeypatch.setattr(process, "sample", gone)
    live.server_ok, live.warm = True, True
    await collectors.sample_process()
    assert not live.server_ok and live.server_reason == "model-server process exited"
    assert not live.ready and "model-server process exited" in live.reasons()


async def test_rss_grown_while_loading_and_warming_is_left_out_of_the_slope(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model loading 2 GB to 10 GB in 40 s, then 1 GB more while warming, then flat: once
    ready its slope is flat, not a leak to the gateway; a leak after that still shows."""
    gib = 2**30
    config = SidecarConfig(
        model_url="http://127.0.0.1:9",
        node_name="n",
        gpu=False,
        model_pid=os.getpid(),  # this process stands in; its RSS and the clock are scripted
        rss_window_s=60.0,
        memory_limit=24 * gib,
    )
    collectors = _Collectors(create_app(config))
    live, process = collectors.live, collectors.process
    script = {"now": 0.0, "rss": 2 * gib}
    sample = process.sample
    monkeypatch.setattr(process, "sample", lambda now=None: sample(now=script["now"]))
    monkeypatch.setattr(process, "_tree_rss", lambda proc: script["rss"])

    async def second(rss: float) -> Snapshot:
        script["now"] += 1.0
        script["rss"] = int(rss)
        await collectors.sample_process()
        return decode(live.encoded())

    for t in range(40):  # loading: the server does not answer yet
        await second(2 * gib + t * gib / 5)
    live.server_ok = True
    for t in range(5):  # warming up
        await second(10 * gib + t * gib / 5)
    live.warm = True
    live.changed()
    assert decode(live.encoded()).rss_slope is None  # nothing measured while serving yet
    for _ in range(30):
        snap = await second(11 * gib)
        assert snap.rss_slope in (None, 0.0) and snap.seconds_to_oom() is None
    assert snap.rss_slope == 0.0
    for t in range(1, 61):  # a real leak, 100 MiB a second, for a whole window
        snap = await second(11 * gib + t * 100 * 2**20)
    assert snap.rss_slope == pytest.approx(100 * 2**20)
    left = snap.seconds_to_oom()
    assert left is not None and left < 300.0  # the gateway drains it


async def test_a_sample_interval_near_the_gateways_staleness_is_warned_of(
    caplog: pytest.LogCaptureFixture, sidecar_beside: SidecarBeside
) -> None:
    routes: dict[str, Reply] = {"/health": text("ok")}
    with caplog.at_level(logging.WARNING, "promptlb.sidecar"):
        async with sidecar_beside(routes, engine="none"):
            pass
        assert not [r for r in caplog.records if "stale_after" in r.getMessage()]
        async with sidecar_beside(routes, engine="none", sample_interval_s=3.0):
            pass
    (warning,) = [r.getMessage() for r in caplog.records if "stale_after" in r.getMessage()]
    assert "--sample-interval 3s" in warning


# --- control from this host only ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "status"),
    [
        ("10.0.0.5", 403),
        ("fd00::5", 403),
        ("127.0.0.1", 200),
        ("::1", 200),
        ("::ffff:127.0.0.1", 200),
    ],
)
async def test_local_control_refuses_posts_from_other_hosts_even_with_the_token(
    peer: str, status: int
) -> None:
    # Every pod holds the one token: read by a compromised pod, it drained the whole fleet.
    token = "t" * 32
    config = SidecarConfig(node_name="n", token=token, local_control=True, gpu=False)
    auth = sidecar_app._auth_middleware(config)
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda key, default=None: (
        (peer, 1234) if key == "peername" else default
    )
    headers = {"Authorization": f"Bearer {token}"}
    request = make_mocked_request("POST", "/drain", headers=headers, transport=transport)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="drained")

    response = await auth(request, handler)
    assert response.status == status
    read = make_mocked_request("GET", "/snapshot", transport=transport)
    assert (await auth(read, handler)).status == 200  # reads stay open to the gateways


async def test_local_control_still_takes_the_pods_own_drain(serve: Serve) -> None:
    token = "t" * 32
    config = SidecarConfig(
        model_url="http://127.0.0.1:9", node_name="n", token=token, local_control=True, gpu=False
    )
    sidecar = create_app(config)
    async with serve(sidecar) as url, aiohttp.ClientSession() as http:
        auth = {"Authorization": f"Bearer {token}"}
        async with http.post(url + "/drain", headers=auth) as response:
            assert response.status == 200 and (await response.json())["draining"] is True
        assert sidecar[LIVE].draining
