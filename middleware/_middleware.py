"""`PromptLBMiddleware`: mount it in any ASGI app; balanced routes go to the model nodes."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from promptlb.shared import ConfigError

from ._asgi import ASGIApp, Message, Receive, Scope, Send, json_error, send_json
from ._balancer import Balancer
from ._client import PromptLBClient
from ._config import Config, load_config
from ._dashboard import send_asset, send_redirect
from ._degrade import Dispatcher
from ._live import Live, build_live, describe
from ._proxy import models_response
from ._status import StatusPage

__all__ = ["PromptLBMiddleware"]

# As a dual-stack listener reports the IPv4 loopback too.
_LOCAL = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost"})
log = logging.getLogger("promptlb.middleware")

ConfigSource = Config | str | Path | Mapping[str, Any]


_STOPPING = frozenset(
    {"lifespan.shutdown.complete", "lifespan.shutdown.failed", "lifespan.startup.failed"}
)


class _StartupFailed(Exception):
    """The balancer did not start: already told to the server as ``lifespan.startup.failed``."""


class PromptLBMiddleware:
    """Balances the configured routes across model nodes; every other route reaches ``app``
    untouched (the same bytes, streaming kept).

    ``config`` is a `Config`, a TOML path, or a mapping of the TOML's shape. Background work
    (gossip, health checks) starts at lifespan startup, or on the first request when the server
    runs without lifespan, and stops at lifespan shutdown. `reload` reads the config again
    without a restart (``promptlb-gateway`` calls it on SIGHUP).
    """

    def __init__(self, app: ASGIApp, *, config: ConfigSource) -> None:
        self.app = app
        self._source = config
        self._live: Live = build_live(load_config(config))
        self.client = PromptLBClient(self._live.dispatcher, self._live.reader, self.reload)
        self._status = StatusPage()
        self._reloading = asyncio.Lock()
        self._reloads: set[asyncio.Task[bool]] = set()  # held: a task only weakly referenced

    # What the current config built; a request reads `_live` once and keeps what it read.
    @property
    def config(self) -> Config:
        return self._live.config

    @property
    def balancer(self) -> Balancer:
        return self._live.balancer

    @property
    def dispatcher(self) -> Dispatcher:
        return self._live.dispatcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan(scope, receive, send)
        if kind != "http":
            return await self.app(scope, receive, send)
        live = self._live
        path = scope["path"]
        root = scope.get("root_path")
        if root and path.startswith(root) and path not in live.routes:
            # Mounted under a prefix (Starlette's Mount, uvicorn's --root-path): ASGI's path
            # carries it, the routes and the node's path do not. Unmatched, every request fell
            # through to the app. Only a path one of ours is left without the prefix: a mount
            # at /v1 still matches /v1/chat/completions whole.
            rest = path[len(root) :]
            if rest in live.routes or rest == live.models_route or rest in live.admin:
                path = rest
                if rest in live.routes:
                    scope = {**scope, "path": rest}
        if path in live.routes:
            if scope["method"] == "POST":
                if not live.balancer.started:
                    await live.balancer.start()
                return await live.proxy(scope, receive, send)
            return await _not_allowed(send, scope["method"], b"POST")
        if path == live.models_route:
            if scope["method"] in ("GET", "HEAD"):  # the server sends no body for a HEAD
                if not live.balancer.started:
                    await live.balancer.start()
                return await models_response(live.balancer, send)
            return await _not_allowed(send, scope["method"], b"GET, HEAD")
        admin = live.admin.get(path)
        if admin is not None:
            return await self._serve_admin(live, admin, scope, send)
        state = scope.get("state")
        if state is None:
            scope["state"] = state = {}
        state["promptlb"] = self.client
        return await self.app(scope, receive, send)

    async def reload(self, config: ConfigSource | None = None) -> bool:
        """Read the config again (``config`` None: the source given at construction, which
        must then be a path) and switch to it without a restart: nodes added and removed,
        weights, strategy options, fallback chains, cache and shedding settings. Requests
        under way finish under the config they started with. A config that does not
        validate is refused with one log line naming the key, and the running one stays;
        returns whether the new one is in force.

        A caller cancelled meanwhile (a request handler's timeout) does not stop it half way:
        it was, between taking over the node table and switching configs, and the config left
        in force had its cache retired and its health and gossip loops stopped."""
        task = asyncio.ensure_future(self._reload(config))
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)
        return await asyncio.shield(task)

    async def _reload(self, config: ConfigSource | None) -> bool:
        source = self._source if config is None else config
        async with self._reloading:
            old = self._live
            try:
                if config is None and not isinstance(source, str | Path):
                    raise ConfigError("config", type(source).__name__, "a file to read again")
                live = build_live(load_config(source), old)
            except ConfigError as exc:
                log.error("promptlb: config reload refused, the running config stays: %s", exc)
                return False
            except Exception:  # a check that let a bad value through: still a refusal
                log.exception("promptlb: config reload refused, the running config stays")
                return False
            added, removed = await live.balancer.succeed(old.balancer)
            self._live = live
            self.client.use(live.dispatcher, live.reader)
            if isinstance(source, str | Path):
                self._source = source
            changes = describe(old.config, live.config, added, removed)
            log.info("promptlb: config reloaded: %s", changes)
            return True

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.get("state")
        if state is not None:
            state["promptlb"] = self.client  # Starlette copies lifespan state into requests

        stopping = {"asked": False, "done": False, "failed": False}

        async def stop() -> None:
            if not stopping["done"]:
                stopping["done"] = True
                async with self._reloading:
                    await self._live.dispatcher.stop()

        async def wrapped() -> Any:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._live.balancer.start()
                except Exception as exc:
                    # Said to the server here: raised into the app's receive(), Starlette let
                    # it out unreported, and uvicorn (lifespan "auto") took that for an app
                    # without lifespan and served on, the app's own startup never run.
                    stopping["failed"] = True
                    await send({"type": "lifespan.startup.failed", "message": f"promptlb: {exc}"})
                    raise _StartupFailed from exc
            elif message["type"] == "lifespan.shutdown":
                stopping["asked"] = True
            return message

        async def sent(message: Message) -> None:
            kind = message["type"]
            if stopping["failed"] and kind.startswith("lifespan.startup"):
                return  # the app's word on a startup already reported failed
            # Stopped after the app's own shutdown, in reverse of startup: its shutdown code
            # may still call the in-app client, which would otherwise start a new session and
            # loops that nothing stops. And after its failed startup: no shutdown follows.
            if kind in _STOPPING:
                await stop()
            await send(message)

        try:
            await self.app(scope, wrapped, sent)
        except _StartupFailed:
            return  # reported; the balancer did not start
        finally:
            # An app that returned, or raised in its shutdown, without saying its shutdown
            # was done: raising, its session and loops were never stopped.
            if stopping["asked"]:
                await stop()

    async def _serve_admin(self, live: Live, which: str, scope: Scope, send: Send) -> None:
        if which == "home":  # the page's relative links need the trailing slash
            return await send_redirect(send, scope["path"] + "/")
        if which.startswith("asset:"):
            # The dashboard is a static shell without data: it asks for the token itself and
            # sends it from script. It is served wherever the data could be had.
            if live.admin_token is None and not self._local(live, scope):
                return await self._refuse(live, send)
            return await send_asset(send, which[6:])
        if not self._admin_allowed(live, scope):
            return await self._refuse(live, send)
        if which == "status":
            return await send_json(send, 200, self._status.render(live.balancer))
        body = live.balancer.metrics.render()
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

    async def _refuse(self, live: Live, send: Send) -> None:
        token = live.admin_token is not None
        await json_error(
            send,
            401 if token else 403,
            "admin endpoints need admin_token(_file) or admin_local_only",
            "permission_error",
            # RFC 9110 15.5.2: a 401 says how to authenticate (the sidecar's does).
            headers=[(b"www-authenticate", b"Bearer")] if token else None,
        )

    def _admin_allowed(self, live: Live, scope: Scope) -> bool:
        if live.admin_token is not None:
            for name, value in scope["headers"]:
                if name == b"authorization":
                    # RFC 9110 11.1: the scheme is case-insensitive (the sidecar agrees).
                    scheme, _, given = value.strip().partition(b" ")
                    return scheme.lower() == b"bearer" and hmac.compare_digest(
                        given.strip(), live.admin_token
                    )
        return self._local(live, scope)

    @staticmethod
    def _local(live: Live, scope: Scope) -> bool:
        if not live.config.admin_local_only:
            return False
        client = scope.get("client")
        if client is None or client[0] not in _LOCAL:
            return False
        # And asked by a loopback name: a web page whose own host name resolves to 127.0.0.1
        # (DNS rebinding) reached these routes from the local browser as same-origin, and
        # read the status and metrics. A browser always sends Host.
        for name, value in scope["headers"]:
            if name == b"host":
                return _loopback_host(value)
        return True


def _loopback_host(value: bytes) -> bool:
    """Whether a Host names this machine by a name no other site's page can carry: a loopback
    or unspecified address, or localhost (a browser resolves *.localhost itself: RFC 6761)."""
    host = value.strip().lower()
    if host.startswith(b"["):  # [::1]:8080
        host = host[1 : host.find(b"]")] if b"]" in host else b""
    else:
        host = host.rpartition(b":")[0] if b":" in host else host
    host = host.removesuffix(b".")  # localhost. is localhost
    if host == b"localhost" or host.endswith(b".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    # 0.0.0.0 too: what a server bound to every interface prints as its address.
    return address.is_loopback or address.is_unspecified


async def _not_allowed(send: Send, method: str, allow: bytes) -> None:
    """A route this middleware serves, asked with another method: 405 and what it allows, in
    the OpenAI shape (it fell through to the app, and the gateway said "no route" of a route
    it has)."""
    await json_error(
        send,
        405,
        f"method {method} is not allowed here; use {allow.decode()}",
        "invalid_request_error",
        headers=[(b"allow", allow)],
    )
