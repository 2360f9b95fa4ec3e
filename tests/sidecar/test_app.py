"""The sidecar app in process, against a model server whose /metrics the test controls."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from aiohttp import web
from promptlb.shared import Snapshot, decode
from promptlb.sidecar import SidecarConfig, create_app
from promptlb.sidecar._app import LIVE

GOOD = "vllm:num_requests_running 3\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\n"


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_malformed_engine_metrics_drop_the_engine_fields_and_log_once_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = {"text": GOOD}

    async def handler(request: web.Request) -> web.Response:
        if request.path == "/metrics":
            return web.Response(text=metrics["text"])
        return web.json_response({"status": "ok"})

    model = web.Application()
    model.router.add_get("/{tail:.*}", handler)
    model_runner, model_url = await serve(model)
    config = SidecarConfig(
        model_url=model_url,
        node_name="n",
        sample_interval_s=0.02,
        warmup_at_start=False,
        warmup_required=False,
        gpu=False,
    )
    sidecar = create_app(config)
    sidecar_runner, _ = await serve(sidecar)
    live = sidecar[LIVE]

    async def engine_after(text: str) -> Snapshot:
        metrics["text"] = text
        await asyncio.sleep(0.2)  # ten sample intervals
        return decode(live.encoded())

    try:
        with caplog.at_level(logging.INFO, "promptlb.sidecar"):
            assert (await engine_after(GOOD)).engine is not None
            assert (await engine_after("vllm:num_requests_running {{{\n")).engine is None
            assert (await engine_after("tgi_queue_size 2\n")).engine is None
            good = await engine_after(GOOD)
            assert good.engine is not None and good.engine.running == 3
    finally:
        await sidecar_runner.cleanup()
        await model_runner.cleanup()
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
