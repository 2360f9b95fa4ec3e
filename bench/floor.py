"""The Python floor for one proxy hop: a minimal pure-ASGI forwarder, for proxy_bench to hold
the gateway against. One aiohttp session, the body streamed back, nothing else.

    python -m promptlb.bench.floor --upstream http://127.0.0.1:8000 --port 0
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
from promptlb.middleware._gateway import serve


def forwarder(upstream: str) -> Any:
    state: dict[str, aiohttp.ClientSession] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                state["http"] = aiohttp.ClientSession(auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            await state["http"].close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        async with state["http"].post(upstream + scope["path"], data=body) as response:
            headers = [(b"content-type", response.headers["content-type"].encode())]
            await send(
                {"type": "http.response.start", "status": response.status, "headers": headers}
            )
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    serve(forwarder(args.upstream), "127.0.0.1", args.port, name="floor", log_level="warning")


if __name__ == "__main__":
    main()
