"""A real cluster for end-to-end tests: emulators, sidecars, and the example app on uvicorn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from openai.types.chat import ChatCompletionMessageParam
from promptlb.emulator import Service, start_command, start_service
from promptlb.middleware import PromptLBMiddleware
from promptlb.middleware._view import NodeView
from promptlb.shared import EngineSample, GpuSample, Snapshot

from tests.conftest import Serve, sidecar_args

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Node:
    name: str
    model: Service
    sidecar: Service | None
    flags: tuple[str, ...]


@dataclass
class Cluster:
    app: Service
    nodes: dict[str, Node]
    config_path: Path
    started: list[Service] = field(default_factory=list)

    def another_app(self) -> Service:
        """A second middleware instance with the same config (the same nodes and cache)."""
        app = start_command(
            "example-app",
            [str(ROOT / "examples" / "app.py"), "--config", str(self.config_path), "--port", "0"],
        )
        self.started.append(app)
        return app

    def restart_model(self, name: str) -> Service:
        """Start the node's emulator again on the port it had (its sidecar points there)."""
        node = self.nodes[name]
        node.model.stop()
        port = str(node.model.port)
        model = start_command("emulator", ["-m", "promptlb.emulator", "--port", port, *node.flags])
        self.started.append(model)
        node.model = model
        return model

    def client(self) -> openai.AsyncOpenAI:
        """The official openai client on the app's ``/v1``, without retries of its own."""
        return openai.AsyncOpenAI(base_url=self.app.url + "/v1", api_key="unused", max_retries=0)

    async def status(self) -> dict[str, Any]:
        """The app's ``/_promptlb/status`` document (asserting that it answered 200)."""
        async with (
            aiohttp.ClientSession() as http,
            http.get(self.app.url + "/_promptlb/status") as response,
        ):
            assert response.status == 200
            body: dict[str, Any] = await response.json()
            return body

    async def until_ready(self, limit: float = 10.0) -> None:
        """Until the app sees every node ready: a sidecar still warming its node at the app's
        start leaves that node out of the first requests."""
        deadline = time.monotonic() + limit
        while {n["state"] for n in (await self.status())["nodes"]} != {"ready"}:
            assert time.monotonic() < deadline, (await self.status())["nodes"]
            await asyncio.sleep(0.05)


MakeCluster = Callable[..., Cluster]
Flags = tuple[str, ...]
Messages = list[ChatCompletionMessageParam]
MakeSnapshot = Callable[..., Snapshot]
MakeNode = Callable[..., NodeView]
OpenAIOver = Callable[[str, list[bytes]], AbstractAsyncContextManager[openai.AsyncOpenAI]]


async def no_app(scope: Any, receive: Any, send: Any) -> None:
    """The app behind a middleware under test that must answer everything itself."""
    raise AssertionError("the app is not reached")


@asynccontextmanager
async def gateway_over(
    serve: Serve, routes: Mapping[str, Handler], **config: Any
) -> AsyncIterator[tuple[PromptLBMiddleware, httpx.AsyncClient]]:
    """A middleware (no app behind it, health checks off) over one in-process node ``n``
    answering ``routes`` (path -> POST handler), and an httpx client on the middleware;
    ``config`` is the rest of its config. Stopped on the way out."""
    node = web.Application()
    for path, handler in routes.items():
        node.router.add_post(path, handler)
    async with serve(node) as url:
        app = PromptLBMiddleware(
            no_app,
            config={"nodes": [{"name": "n", "url": url}], "health": {"enabled": False}, **config},
        )
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                yield app, http
        finally:
            await app.dispatcher.stop()


def chat_node(chat: Handler) -> web.Application:
    """A node's HTTP face for in-process tests: ``chat`` answers chat completions, and
    ``/health`` says ok, so the balancer's health check takes it in."""

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


@pytest.fixture
def openai_over(serve: Serve) -> OpenAIOver:
    """``async with openai_over(path, events) as api:`` an openai client whose ``path`` answers
    ``events`` from a real loopback server: the client's own HTTP stack and SSE parser read
    them, as from a node."""

    @asynccontextmanager
    async def over(path: str, events: list[bytes]) -> AsyncIterator[openai.AsyncOpenAI]:
        async def answer(request: web.Request) -> web.Response:
            return web.Response(body=b"".join(events), content_type="text/event-stream")

        app = web.Application()
        app.router.add_post(path, answer)
        async with serve(app) as url:
            api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            try:
                yield api
            finally:
                await api.close()

    return over


@pytest.fixture
def fast() -> Flags:
    """Emulator flags for a quick node: 20 ms to the first token, then 400 tokens a second."""
    return ("--ttft-ms", "20", "--tokens-per-s", "400")


@pytest.fixture
def hello() -> Messages:
    """The one-message chat most end-to-end requests send."""
    return [{"role": "user", "content": "hello"}]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[MakeCluster]:
    """``cluster({"a": ("--slots", "2"), "b": ()}, config="strategy='p2c'")``.

    Every node serves model ``m`` (unless its flags name ``--model``s of their own) and has a
    sidecar unless its flags start with ``"nosidecar"``. The config text is prepended to the
    generated ``[[nodes]]`` tables. ``app_config`` (a path) starts one more app, sharing them.
    """
    started: list[Service] = []

    def make(
        nodes: dict[str, tuple[str, ...]], config: str = "", *, sidecar_flags: tuple[str, ...] = ()
    ) -> Cluster:
        made: dict[str, Node] = {}
        tables = []
        for name, raw_flags in nodes.items():
            with_sidecar = not raw_flags or raw_flags[0] != "nosidecar"
            own = raw_flags if with_sidecar else raw_flags[1:]
            models = [own[i + 1] for i, f in enumerate(own) if f == "--model"] or ["m"]
            flags = own if "--model" in own else ("--model", "m", *own)
            model = start_service("emulator", *flags)
            started.append(model)
            sidecar = None
            if with_sidecar:
                sidecar = start_service("sidecar", *sidecar_args(model.url, name, *sidecar_flags))
                started.append(sidecar)
            made[name] = Node(name, model, sidecar, flags)
            table = f"[[nodes]]\nname = '{name}'\nurl = '{model.url}'\nmodels = {models!r}\n"
            if sidecar is not None:
                table += f"sidecar = '{sidecar.url}'\n"
            tables.append(table)
        path = tmp_path / "promptlb.toml"
        path.write_text("admin_local_only = true\n" + config + "\n" + "\n".join(tables))
        app = start_command(
            "example-app", [str(ROOT / "examples" / "app.py"), "--config", str(path), "--port", "0"]
        )
        started.append(app)
        return Cluster(app, made, path, started)

    yield make
    for service in reversed(started):
        service.stop()


# --- nodes and snapshots for the pure-logic tests (strategies, node table, shedding) ----------

SNAPSHOT_KEYS = frozenset(
    {"seq", "boot", "ready", "warm", "draining", "gpus", "cpu", "mem"}
    | {"running", "waiting", "kv_cache", "tps", "kv_tokens", "age_ms", "v"}
)


def _snapshot(
    name: str,
    seq: int = 1,
    *,
    boot: str = "b00t",
    ready: bool = True,
    warm: bool = True,
    draining: bool = False,
    gpus: Sequence[float] = (),
    cpu: float | None = None,
    mem: float | None = None,
    running: int | None = None,
    waiting: int = 0,
    kv_cache: float | None = None,
    tps: float | None = None,
    kv_tokens: int | None = None,
    age_ms: int = 0,
    v: int = 1,
) -> Snapshot:
    engine = None
    if running is not None:
        engine = EngineSample(
            running=running,
            waiting=waiting,
            kv_cache=kv_cache,
            tps=tps,
            kv_tokens=kv_tokens,
            age_ms=age_ms,
        )
    return Snapshot(
        node=name,
        boot=boot,
        seq=seq,
        v=v,
        ts=1_700_000_000.0,
        ready=ready,
        warm=warm,
        draining=draining,
        cpu=cpu,
        mem=mem,
        gpus=tuple(GpuSample(i, u, 1_000, 80_000) for i, u in enumerate(gpus)),
        engine=engine,
    )


@pytest.fixture
def snap() -> MakeSnapshot:
    """``snap("a", seq=2, gpus=[0.9], cpu=0.5, running=3, waiting=1)``: a ready, warm snapshot
    of node ``a``, with GPUs at the given utilisations; it has an engine sample only when
    ``running`` is given."""
    return _snapshot


@pytest.fixture
def node() -> MakeNode:
    """``node("a", running=2, weight=2.0, tags={"gpu"})``: the view of node ``a``. Any of
    ``snap``'s keywords gives it a snapshot built by ``snap``; without them it has none (its
    load is unknown). The other keywords are ``NodeView`` fields."""

    def make(name: str, *, tags: Iterable[str] = (), **fields: Any) -> NodeView:
        own = {key: fields.pop(key) for key in list(fields) if key in SNAPSHOT_KEYS}
        snapshot = _snapshot(name, **own) if own else None
        return NodeView(
            name=name,
            url=f"http://{name}:8000",
            tags=frozenset(tags),
            snapshot=snapshot,
            **fields,
        )

    return make
