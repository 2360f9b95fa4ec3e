"""The live oracle: a router over emulated nodes that knows each node's true queue and true KV
cache, the reference the cache-aware default is held to in `promptlb-bench cluster` (the
simulator's ``oracle``, on real processes).

For every request it asks each node what the request would cost there now (``POST
/_emulator/oracle``: the wait before a slot by the node's own forecast, and the service by its
own cache), sends it to the least expected completion (ties broken at random, so that idle
nodes share new prefixes) and streams the answer back. Only emulators answer that question:
this is a measuring instrument, not a router anyone could deploy.

Run: ``python -m promptlb.bench._oracle --port 0 --nodes '{"a": "http://127.0.0.1:PORT"}'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import AsyncIterator, Mapping, Sequence

import aiohttp
from aiohttp import web
from promptlb.shared._serve import serve

from ._loadgen import UNREADABLE, UPSTREAM_HEADER

__all__ = ["create_app", "main"]

_ASK_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
SESSION = web.AppKey("promptlb_oracle_session", aiohttp.ClientSession)


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message[:500], "type": "oracle_error", "code": status}}
    return web.json_response(body, status=status)


def create_app(nodes: Mapping[str, str], seed: int = 1) -> web.Application:
    rng = random.Random(seed)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        # No pool limit, as the gateway's and the load generator's: at aiohttp's default 100,
        # streams queued on the emulators held every connection, and the cost probes timed
        # out waiting for one (nodes read as down).
        app[SESSION] = aiohttp.ClientSession(
            auto_decompress=False, connector=aiohttp.TCPConnector(limit=0)
        )
        yield
        await app[SESSION].close()

    async def cost(http: aiohttp.ClientSession, url: str, raw: bytes, chat: str) -> float | None:
        try:
            async with http.post(
                url + "/_emulator/oracle",
                params={"chat": chat},  # the endpoint, which decides the field read
                data=raw,
                headers={"Content-Type": "application/json"},
                timeout=_ASK_TIMEOUT,
            ) as response:
                if response.status != 200:
                    return None
                answer = await response.json()
            return float(answer["wait_s"]) + float(answer["service_s"])
        except UNREADABLE:
            return None  # down or hung: not a candidate

    async def route(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            json.loads(raw)
        except ValueError:
            return _error(400, "request body is not valid JSON")
        http = request.app[SESSION]
        names = list(nodes)
        chat = "1" if request.path.endswith("/chat/completions") else "0"
        costs = await asyncio.gather(*(cost(http, nodes[n], raw, chat) for n in names))
        known = [(c, n) for c, n in zip(costs, names, strict=True) if c is not None]
        if not known:
            return _error(503, "no node answered the oracle's question")
        best = min(c for c, _ in known)
        chosen = rng.choice([n for c, n in known if c <= best + 1e-9])
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        try:
            async with http.post(nodes[chosen] + request.path, data=raw, headers=headers) as up:
                out = web.StreamResponse(status=up.status)
                out.content_type = up.content_type
                out.headers[UPSTREAM_HEADER] = chosen
                await out.prepare(request)
                try:
                    async for chunk in up.content.iter_any():
                        await out.write(chunk)
                except aiohttp.ClientError:
                    return out  # the node failed mid-answer: it ends there, as through a proxy
                await out.write_eof()
                return out
        except aiohttp.ClientError as exc:
            return _error(502, f"{chosen}: {exc}")

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", route)
    app.router.add_post("/v1/completions", route)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m promptlb.bench._oracle")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--nodes", required=True, help='JSON {"name": "http://127.0.0.1:PORT"}')
    args = parser.parse_args(argv)
    nodes = json.loads(args.nodes)
    if not isinstance(nodes, dict) or not nodes:
        parser.error("--nodes: expected a non-empty JSON object of name -> URL")
    serve(create_app(nodes), "127.0.0.1", args.port, "oracle-peer")


if __name__ == "__main__":
    main()
