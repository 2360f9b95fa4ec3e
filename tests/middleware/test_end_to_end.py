"""The middleware in the example app on uvicorn, in front of emulators with sidecars, all real
processes, driven by the official openai client."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import aiohttp
import openai
import pytest

from tests.middleware.conftest import Flags, MakeCluster, Messages

HEALTH = "[health]\ninterval = '300ms'\ninterval_jitter = '50ms'\ntimeout = '300ms'\n"


async def chat_node(api: openai.AsyncOpenAI, hello: Messages, max_tokens: int = 4) -> str:
    raw = await api.chat.completions.with_raw_response.create(
        model="m", messages=hello, max_tokens=max_tokens
    )
    raw.parse()
    return raw.headers["x-promptlb-node"]


async def later(
    api: openai.AsyncOpenAI, hello: Messages, delay: float, max_tokens: int = 20
) -> str:
    await asyncio.sleep(delay)
    return await chat_node(api, hello, max_tokens)


async def test_chat_streaming_and_models_through_the_openai_client(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    c = cluster({"a": fast, "b": fast})
    api = c.client()
    raw = await api.chat.completions.with_raw_response.create(
        model="m", messages=hello, max_tokens=5
    )
    answer = raw.parse()
    assert answer.choices[0].message.content == "the quick brown fox jumps "
    assert raw.headers["x-promptlb-node"] in ("a", "b")
    assert raw.headers["x-promptlb-model"] == "m"
    assert raw.headers["x-promptlb-attempts"] == "1"
    stream = await api.chat.completions.create(
        model="m",
        messages=hello,
        max_tokens=12,
        stream=True,
    )
    text = "".join(
        [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    )
    assert text.split() == [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "small",
        "models",
    ]
    completion = await api.completions.create(model="m", prompt="once", max_tokens=3)
    assert completion.choices[0].text == "the quick brown "
    embedding = await api.embeddings.create(model="m", input=["x", "y"])
    assert len(embedding.data) == 2
    assert [m.id for m in (await api.models.list()).data] == ["m"]
    with pytest.raises(openai.NotFoundError):
        await api.chat.completions.create(model="nope", messages=hello)


async def test_app_routes_pass_through_and_the_in_app_client_routes(
    cluster: MakeCluster, fast: Flags
) -> None:
    c = cluster({"a": fast})
    async with aiohttp.ClientSession() as http:
        async with http.get(c.app.url + "/") as response:
            assert await response.text() == "hello from the app itself\n"
            assert "x-promptlb-node" not in response.headers
        async with http.get(c.app.url + "/ticker") as response:
            assert response.headers["transfer-encoding"] == "chunked"
            assert await response.text() == "".join(f"tick {i}\n" for i in range(5))
        async with http.post(c.app.url + "/summarize?model=m", data=b"some text") as response:
            assert response.status == 200
            assert (await response.json())["summary"].startswith("the quick")
        async with http.post(c.app.url + "/summarize?model=nope", data=b"x") as response:
            assert response.status == 404  # the app caught PromptLBError and answered with it


@pytest.mark.parametrize("strategy", ["round_robin", "weighted", "least_conn", "resource", "p2c"])
async def test_every_strategy_spreads_load(
    cluster: MakeCluster, strategy: str, fast: Flags, hello: Messages
) -> None:
    # Paced arrivals of requests that last a while, with fresh snapshots: the load-aware
    # strategies then see the load they cause (resource reads snapshots alone).
    c = cluster(
        {"a": fast, "b": fast, "c": fast}, f"strategy = '{strategy}'\ngossip_interval = '100ms'\n"
    )
    api = c.client()
    picks = collections.Counter(
        await asyncio.gather(*(later(api, hello, i * 0.02, 80) for i in range(60)))
    )
    assert set(picks) == {"a", "b", "c"}, picks
    assert min(picks.values()) >= 6, picks  # nobody starved (an even share is 20)


async def test_p2c_sends_less_to_a_saturated_node(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    slow = ("--slots", "1", "--ttft-ms", "50", "--tokens-per-s", "40")
    c = cluster(
        {"slow": slow, "fast": ("--slots", "32", *fast)},
        "strategy = 'p2c'\ngossip_interval = '200ms'\n",
    )
    api = c.client()
    # Open-loop arrivals, 40 a second: the slow node's requests pile up, the fast one's do not.
    picks = collections.Counter(
        await asyncio.gather(*(later(api, hello, i * 0.025) for i in range(60)))
    )
    assert picks["fast"] > 3 * picks["slow"], picks


async def test_a_killed_node_is_routed_around_and_comes_back(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    config = "strategy = 'round_robin'\n" + HEALTH + "[retry]\nper_try_timeout = '2s'\n"
    c = cluster({"a": fast, "b": fast, "c": fast}, config)
    api = c.client()
    assert {await chat_node(api, hello) for _ in range(9)} == {"a", "b", "c"}
    c.nodes["c"].model.proc.kill()
    c.nodes["c"].model.proc.wait(timeout=5)
    # Every request still succeeds: a connect error is retried on another node.
    nodes = [await chat_node(api, hello) for _ in range(12)]
    assert "c" not in nodes
    # Two health intervals (0.35 s) take it out of rotation; polled, not slept, so that a
    # loaded machine's late round does not decide the test.
    deadline = time.monotonic() + 10
    while (await c.status())["nodes"][2]["state"] not in ("unhealthy", "ejected"):
        assert time.monotonic() < deadline, str((await c.status())["nodes"][2])
        await asyncio.sleep(0.1)
    c.restart_model("c")
    deadline = time.monotonic() + 10
    while "c" not in [await chat_node(api, hello) for _ in range(6)]:
        assert time.monotonic() < deadline, str((await c.status())["nodes"][2])
        await asyncio.sleep(0.2)


async def test_a_hanging_node_times_out_and_the_request_is_retried(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    # Without a sidecar the node looks healthy (its /health answers) while requests hang.
    config = "strategy = 'round_robin'\n[retry]\nper_try_timeout = '500ms'\n"
    c = cluster({"hang": ("nosidecar", "--hang-after", "1", *fast), "ok": fast}, config)
    api = c.client()
    async with (
        aiohttp.ClientSession() as http,
        http.post(  # its one answer: it hangs from now
            c.nodes["hang"].model.url + "/v1/chat/completions",
            json={"messages": hello, "max_tokens": 1},
        ) as response,
    ):
        assert response.status == 200
    attempts = []
    for _ in range(6):
        raw = await api.chat.completions.with_raw_response.create(
            model="m", messages=hello, max_tokens=3
        )
        assert raw.headers["x-promptlb-node"] == "ok"
        attempts.append(raw.headers["x-promptlb-attempts"])
    assert "2" in attempts  # some went to the hanging node first, timed out, and were retried


async def test_a_draining_node_gets_no_new_requests(
    cluster: MakeCluster, tmp_path: Any, fast: Flags, hello: Messages
) -> None:
    token = tmp_path / "token"
    token.write_text("drain-test-token")
    c = cluster(
        {"a": fast, "b": fast},
        "strategy = 'round_robin'\ngossip_interval = '200ms'\n" + HEALTH,
        sidecar_flags=("--token-file", str(token)),
    )
    api = c.client()
    sidecar = c.nodes["a"].sidecar
    assert sidecar is not None
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            sidecar.url + "/drain", headers={"Authorization": "Bearer drain-test-token"}
        ) as r,
    ):
        assert r.status == 200
    deadline = time.monotonic() + 10
    while (state := {n["name"]: n["state"] for n in (await c.status())["nodes"]}["a"]) not in (
        "draining",
        "unhealthy",
    ):
        assert time.monotonic() < deadline, state
        await asyncio.sleep(0.1)
    assert {await chat_node(api, hello) for _ in range(10)} == {"b"}


async def test_a_client_that_leaves_mid_stream_cancels_upstream(
    cluster: MakeCluster, hello: Messages
) -> None:
    c = cluster({"a": ("--tokens-per-s", "20", "--ttft-ms", "10")})
    body = {"model": "m", "messages": hello, "max_tokens": 200, "stream": True}
    async with aiohttp.ClientSession() as http:
        response = await http.post(c.app.url + "/v1/chat/completions", json=body)
        assert response.status == 200
        await response.content.readline()
        node = (await c.status())["nodes"][0]
        assert node["in_flight"] == 1
        response.close()  # the client goes away after the first event
        deadline = time.monotonic() + 5
        while True:
            node = (await c.status())["nodes"][0]
            async with http.get(c.nodes["a"].model.url + "/metrics") as metrics:
                running = 'vllm:num_requests_running{model_name="m"} 0.0' in await metrics.text()
            if node["in_flight"] == 0 and running:
                break
            assert time.monotonic() < deadline, node
            await asyncio.sleep(0.05)
    assert node["failures"] == 0  # a client leaving is not the node's fault


async def test_a_leaking_node_is_drained_before_it_runs_out_of_memory(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    """The sidecar projects the leak into the memory left (its limit, set small here); the
    gateway stops sending new requests there while the other node serves."""
    c = cluster(
        {"leaky": ("--leak-mb-per-req", "8", *fast), "sound": fast},
        "[outlier]\ndrain_before_oom = '300s'\n",
        sidecar_flags=("--memory-limit-mb", "4000", "--rss-window", "2s"),
    )
    api = c.client()
    served: list[str] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        raw = await api.chat.completions.with_raw_response.create(
            model="m", messages=hello, max_tokens=2
        )
        served.append(raw.headers["x-promptlb-node"])
        states = {n["name"]: n["state"] for n in (await c.status())["nodes"]}
        if states["leaky"] == "leaking":
            break
        await asyncio.sleep(0.02)
    assert states["leaky"] == "leaking", states
    after = []
    for _ in range(10):
        raw = await api.chat.completions.with_raw_response.create(
            model="m", messages=hello, max_tokens=2
        )
        after.append(raw.headers["x-promptlb-node"])
    assert after == ["sound"] * 10
    assert "leaky" in served
