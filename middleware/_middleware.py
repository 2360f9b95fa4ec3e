"""`PromptLBMiddleware`: mount it in any ASGI app; balanced routes go to the model nodes."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._asgi import ASGIApp, Receive, Scope, Send, json_error, send_json
from ._balancer import Balancer
from ._client import PromptLBClient
from ._config import Config, load_config
from ._degrade import Dispatcher
from ._proxy import Proxy, models_response
from ._request import RequestReader
from ._status import status_json

__all__ = ["PromptLBMiddleware"]

_LOCAL = frozenset({"127.0.0.1", "::1", "localhost"})


class PromptLBMiddleware:
    """Balances the configured routes across model nodes; every other route reaches ``app``
    untouched (the same bytes, streaming kept).

    ``config`` is a `Config`, a TOML path, or a mapping of the TOML's shape. Background work
    (gossip, health checks) starts at lifespan startup, or on the first request when the server
    runs without lifespan, and stops at lifespan shutdown.
    """

    def __init__(self, app: ASGIApp, *, config: Config | str | Path | Mapping[str, Any]) -> None:
        self.app = app
        self.config = load_config(config)
        self.balancer = Balancer(self.config)
        self.dispatcher = Dispatcher(self.balancer)
        reader = RequestReader(self.config, self.balancer.admission)
        self.client = PromptLBClient(self.dispatcher, reader)
        self._proxy = Proxy(self.dispatcher, reader, self.config)
        self._routes = frozenset(self.config.routes)
        self._models_route = self.config.models_route
        prefix = self.config.admin_prefix
        self._admin = {prefix + "/status": "status", prefix + "/metrics": "metrics"}
        token = self.config.admin_secret()
        self._admin_token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan(scope, receive, send)
        if kind != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in self._routes and scope["method"] == "POST":
            if not self.balancer.started:
                await self.balancer.start()
            return await self._proxy(scope, receive, send)
        if path == self._models_route and scope["method"] == "GET":
            if not self.balancer.started:
                await self.balancer.start()
            return await models_response(self.balancer, send)
        admin = self._admin.get(path)
        if admin is not None:
            return await self._serve_admin(admin, scope, send)
        state = scope.get("state")
        if state is None:
            scope["state"] = state = {}
        state["promptlb"] = self.client
        return await self.app(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.get("state")
        if state is not None:
            state["promptlb"] = self.client  # Starlette copies lifespan state into requests

        async def wrapped() -> Any:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.balancer.start()
            elif message["type"] == "lifespan.shutdown":
                await self.dispatcher.stop()
            return message

        await self.app(scope, wrapped, send)

    async def _serve_admin(self, which: str, scope: Scope, send: Send) -> None:
        if not self._admin_allowed(scope):
            await json_error(
                send,
                403 if self._admin_token is None else 401,
                "admin endpoints need admin_token(_file) or admin_local_only",
                "permission_error",
            )
            return
        if which == "status":
            await send_json(send, 200, status_json(self.balancer))
            return
        body = self.balancer.metrics.render()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _admin_allowed(self, scope: Scope) -> bool:
        if self._admin_token is not None:
            for name, value in scope["headers"]:
                if name == b"authorization":
                    # RFC 9110 11.1: the scheme is case-insensitive (the sidecar agrees).
                    scheme, _, given = value.strip().partition(b" ")
                    return scheme.lower() == b"bearer" and hmac.compare_digest(
                        given.strip(), self._admin_token
                    )
        if self.config.admin_local_only:
            client = scope.get("client")
            return client is not None and client[0] in _LOCAL
        return False
