"""The middleware in process: mounting, pass-through, lifespan, bad input, admin access."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from promptlb.middleware import PromptLBClient, PromptLBMiddleware
from promptlb.shared import ConfigError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tests.conftest import Serve

DEAD = "http://127.0.0.1:9"  # discard port: nothing listens, connections are refused at once


def config(**extra: Any) -> dict[str, Any]:
    return {
        "nodes": [{"name": "a", "url": DEAD, "models": ["m"]}],
        "health": {"interval": "1s", "timeout": "200ms"},
        **extra,
    }


async def recorder_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A raw app that echoes what it received, in three body chunks."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send(
        {
            "type": "http.response.start",
            "status": 201,
            "headers": [(b"x-app", b"1"), (b"content-type", b"application/octet-stream")],
        }
    )
    for chunk in (b"one,", body, b",three"):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_other_routes_pass_through_message_for_message() -> None:
    app = PromptLBMiddleware(recorder_app, config=config())  # type: ignore[arg-type]
    inbound = [
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": False},
    ]
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbound.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/upload",
        "headers": [],
        "query_string": b"",
    }
    await app(scope, receive, send)
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 4
    assert sent[0]["status"] == 201
    assert sent[0]["headers"] == [(b"x-app", b"1"), (b"content-type", b"application/octet-stream")]
    assert [m["body"] for m in sent[1:]] == [b"one,", b"abcd", b",three", b""]
    assert not app.balancer.started  # nothing balanced was asked for: nothing started


async def test_non_http_scopes_reach_the_app_untouched() -> None:
    seen: list[str] = []

    async def ws_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    app = PromptLBMiddleware(ws_app, config=config())  # type: ignore[arg-type]
    await app({"type": "websocket", "path": "/ws"}, None, None)  # type: ignore[arg-type]
    assert seen == ["websocket"]


def test_invalid_config_fails_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"strategy_options\.queue_scale"):
        PromptLBMiddleware(
            recorder_app,  # type: ignore[arg-type]
            config=config(strategy="p2c", strategy_options={"queue_scale": -1}),
        )
    with pytest.raises(ConfigError, match="nodes"):
        PromptLBMiddleware(recorder_app, config={"nodes": []})  # type: ignore[arg-type]


async def test_bad_requests_get_openai_shaped_errors() -> None:
    app = PromptLBMiddleware(
        recorder_app,  # type: ignore[arg-type]
        config=config(max_body_bytes=2048),
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        url = "/v1/chat/completions"
        too_big = await http.post(url, content=b"x" * 4096)
        assert too_big.status_code == 413
        assert too_big.json()["error"]["type"] == "invalid_request_error"
        not_json = await http.post(url, content=b"{nope")
        assert not_json.status_code == 400
        no_model = await http.post(url, json={"messages": []})
        assert no_model.status_code == 400
        assert no_model.json()["error"]["param"] == "model"
        unknown = await http.post(url, json={"model": "other", "messages": []})
        assert unknown.status_code == 404
        # The only node is down: a quick 503 with Retry-After, no waiting on the dead node.
        down = await http.post(url, json={"model": "m", "messages": []})
        assert down.status_code == 503
        assert down.headers["retry-after"] == "1"
        assert "no candidate node" in down.json()["error"]["message"]
    await app.balancer.stop()


async def test_a_balancer_that_cannot_start_fails_the_startup_the_server_sees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Raised into the app's receive(), Starlette let it out unreported, and uvicorn under
    # lifespan "auto" served on as if the app had no lifespan, its own startup never run.
    app = PromptLBMiddleware(Starlette(), config=config())

    async def broken() -> None:
        raise ModuleNotFoundError("No module named 'redis'")

    monkeypatch.setattr(app.balancer, "start", broken)
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await app({"type": "lifespan", "state": {}}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "No module named 'redis'" in sent[0]["message"]


async def test_the_apps_own_failed_startup_stops_the_balancer() -> None:
    async def failing(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "the app's database is down"})

    app = PromptLBMiddleware(failing, config=config())
    sent: list[str] = []

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message["type"])
        if message["type"] == "lifespan.startup.failed":
            assert not app.balancer.started  # no shutdown comes to stop it

    await app({"type": "lifespan", "state": {}}, receive, send)
    assert sent == ["lifespan.startup.failed"]


async def test_lifespan_starts_and_stops_background_work_cleanly() -> None:
    app = PromptLBMiddleware(Starlette(), config=config())
    before = asyncio.all_tasks()
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []
    proceed = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if len(messages) == 1:
            await proceed.wait()
        return messages.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message["type"])
        if message["type"] == "lifespan.startup.complete":
            assert app.balancer.started
            # Gossip and health loops. Counted as the tasks not there before: a stray task of
            # an earlier test (a collected client's close) may end meanwhile.
            assert len(asyncio.all_tasks() - before) >= 2
            proceed.set()

    await app({"type": "lifespan", "state": {}}, receive, send)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert not app.balancer.started
    assert asyncio.all_tasks() - before == set()  # nothing of ours left pending


async def test_an_app_that_raises_in_its_shutdown_still_has_the_middleware_stopped() -> None:
    # A plain ASGI app (or a framework) that raises in its shutdown without saying it failed:
    # the balancer's session and loops were never stopped.
    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "lifespan.startup"
        await send({"type": "lifespan.startup.complete"})
        assert (await receive())["type"] == "lifespan.shutdown"
        raise RuntimeError("the app's own shutdown failed")

    mw = PromptLBMiddleware(app, config=config())
    before = asyncio.all_tasks()
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:
        pass

    with pytest.raises(RuntimeError, match="shutdown failed"):
        await mw({"type": "lifespan", "state": {}}, receive, send)
    assert not mw.balancer.started
    assert asyncio.all_tasks() - before == set()


async def test_the_app_shuts_down_before_the_middleware_stops() -> None:
    """In reverse of startup: the app's shutdown may still use the in-app client. The
    middleware stopped first, and a call then started a new session and loops that nothing
    stopped."""
    seen: dict[str, bool] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        seen["running at the app's shutdown"] = mw.balancer.started

    mw = PromptLBMiddleware(Starlette(lifespan=lifespan), config=config())
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message["type"])

    await mw({"type": "lifespan", "state": {}}, receive, send)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert seen == {"running at the app's shutdown": True}
    assert not mw.balancer.started


async def test_the_in_app_client_is_on_request_state() -> None:
    async def route(request: Request) -> PlainTextResponse:
        return PlainTextResponse(type(request.state.promptlb).__name__)

    app = PromptLBMiddleware(Starlette(routes=[Route("/", route)]), config=config())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as http:
        assert (await http.get("/")).text == PromptLBClient.__name__


@pytest.mark.parametrize(
    ("extra", "headers", "status"),
    [
        ({}, {}, 403),
        ({"admin_token": "s3cret-admin"}, {}, 401),
        ({"admin_token": "s3cret-admin"}, {"Authorization": "Bearer wrong"}, 401),
        ({"admin_token": "s3cret-admin"}, {"Authorization": "Bearer s3cret-admin"}, 200),
        # RFC 9110: the scheme is case-insensitive, as the sidecar has it
        ({"admin_token": "s3cret-admin"}, {"Authorization": "bearer s3cret-admin"}, 200),
        ({"admin_token": "s3cret-admin"}, {"Authorization": "BEARER  s3cret-admin"}, 200),
        ({"admin_token": "s3cret-admin"}, {"Authorization": "Basic s3cret-admin"}, 401),
        ({"admin_token": "s3cret-admin"}, {"Authorization": "s3cret-admin"}, 401),
        ({"admin_local_only": True}, {}, 200),  # httpx's ASGI client is 127.0.0.1
    ],
)
async def test_admin_endpoints_are_closed_unless_configured(
    extra: dict[str, Any], headers: dict[str, str], status: int
) -> None:
    app = PromptLBMiddleware(recorder_app, config=config(**extra))  # type: ignore[arg-type]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost:8080"
    ) as http:
        for path in ("/_promptlb/status", "/_promptlb/metrics"):
            response = await http.get(path, headers=headers)
            assert response.status_code == status, path
            if status == 401:  # RFC 9110 15.5.2: a 401 says how to authenticate
                assert response.headers["www-authenticate"] == "Bearer"
        if status == 200:
            body = (await http.get("/_promptlb/status", headers=headers)).json()
            assert body["nodes"][0]["name"] == "a"
            metrics = (await http.get("/_promptlb/metrics", headers=headers)).text
            assert "promptlb_in_flight_requests{" in metrics


@pytest.mark.parametrize(
    ("client", "status"), [("::ffff:127.0.0.1", 200), ("::ffff:10.0.0.9", 403)]
)
async def test_admin_local_only_takes_the_loopback_as_a_dual_stack_listener_reports_it(
    client: str, status: int
) -> None:
    app = PromptLBMiddleware(recorder_app, config=config(admin_local_only=True))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app, client=(client, 50000))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080") as http:
        assert (await http.get("/_promptlb/status")).status_code == status


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("localhost:8080", 200),
        ("127.0.0.1", 200),
        ("127.0.0.2:80", 200),
        ("[::1]:8080", 200),
        ("dash.localhost:8080", 200),
        ("localhost.:8080", 200),
        ("0.0.0.0:8000", 200),  # what a server bound to every interface prints
        ("[::ffff:127.0.0.1]:8080", 200),
        ("[::]:8080", 200),
        # DNS rebinding: a page whose own name resolves to 127.0.0.1, in the local browser.
        ("attacker.example:8080", 403),
        ("127.0.0.1.attacker.example", 403),
        ("localhost.attacker.example", 403),
    ],
)
async def test_admin_local_only_answers_only_a_loopback_host_name(host: str, status: int) -> None:
    app = PromptLBMiddleware(recorder_app, config=config(admin_local_only=True))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 50000))
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
        for path in (
            "/_promptlb/status",
            "/_promptlb/metrics",
            "/_promptlb/dashboard.js",
        ):
            response = await http.get(path, headers={"Host": host})
            assert response.status_code == status, path


async def test_the_admin_token_can_come_from_a_file(tmp_path: Path) -> None:
    """A Kubernetes Secret mounts as a file: the token need not sit in the config."""
    token = tmp_path / "admin-token"
    token.write_text("s3cret-admin\n")
    from_file = config(admin_token_file=str(token))
    app = PromptLBMiddleware(recorder_app, config=from_file)  # type: ignore[arg-type]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as http:
        assert (await http.get("/_promptlb/metrics")).status_code == 401
        good = {"Authorization": "Bearer s3cret-admin"}
        assert (await http.get("/_promptlb/metrics", headers=good)).status_code == 200
    both = config(admin_token="x", admin_token_file=str(token))
    with pytest.raises(ConfigError, match="admin_token_file"):
        PromptLBMiddleware(recorder_app, config=both)  # type: ignore[arg-type]


def test_the_status_page_scores_with_the_configured_options_through_affinity() -> None:
    from promptlb.middleware._balancer import Balancer
    from promptlb.middleware._config import load_config
    from promptlb.middleware._status import status_json

    config = load_config(
        {
            "nodes": [{"name": "a", "url": "http://127.0.0.1:9"}],
            "strategy": "p2c",
            "strategy_options": {"unknown_score": 0.9},
            "affinity": {},
        }
    )
    lb = Balancer(config)
    assert lb.strategy.name == "p2c+affinity"
    # no snapshot yet: the score is the configured unknown_score, not the default 0.5
    assert status_json(lb)["nodes"][0]["score"]["score"] == 0.9


async def test_a_first_burst_without_lifespan_waits_for_the_first_health_round(
    serve: Serve,
) -> None:
    # Mounted without lifespan: the first request starts the balancer. The others of that
    # burst went on as soon as its session existed, before the first health round had made
    # any node healthy, and got 503s.
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)
        return web.Response(text="ok")

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    node = web.Application()
    node.router.add_get("/health", health)
    node.router.add_post("/v1/chat/completions", chat)
    async with serve(node) as url:
        app = PromptLBMiddleware(
            recorder_app,  # type: ignore[arg-type]
            config={"nodes": [{"name": "a", "url": url, "models": ["m"]}]},
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=10) as http:
            body = {"model": "m", "messages": []}
            answers = await asyncio.gather(
                *(http.post("/v1/chat/completions", json=body) for _ in range(5))
            )
        await app.balancer.stop()
    assert [a.status_code for a in answers] == [200] * 5


async def test_a_reload_that_fails_any_other_way_is_still_a_refusal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A check that lets a bad value through raised out of reload(): under SIGHUP an
    # unretrieved task exception, not the refusal line, and the caller saw no answer.
    config = {"nodes": [{"name": "a", "url": "http://127.0.0.1:9"}]}
    app = PromptLBMiddleware(None, config=config)  # type: ignore[arg-type]
    before = app.config

    def broken(*args: Any) -> Any:
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr("promptlb.middleware._middleware.build_live", broken)
    with caplog.at_level("ERROR", logger="promptlb"):
        assert not await app.reload(config)
    assert app.config is before
    assert any("reload refused" in r.getMessage() for r in caplog.records)
