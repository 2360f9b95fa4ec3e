"""An existing Starlette app with promptlb mounted (FastAPI apps mount it the same way).

    python examples/app.py --config examples/cluster.toml --port 8080

The OpenAI routes (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models) are
balanced across the nodes of the config; the app's own routes are untouched, and they can call
the balancer themselves through ``request.state.promptlb``.
"""

from __future__ import annotations

import argparse
import os

from promptlb.middleware import PromptLBError, PromptLBMiddleware
from promptlb.middleware._gateway import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello from the app itself\n")


async def summarize(request: Request) -> JSONResponse:
    """App code using the balancer directly: routed and retried like proxied traffic."""
    text = (await request.body()).decode() or "nothing"
    try:
        answer = await request.state.promptlb.chat(
            model=request.query_params.get("model", "llama-demo"),
            max_tokens=16,
            messages=[{"role": "user", "content": f"Summarize: {text}"}],
        )
    except PromptLBError as exc:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)
    return JSONResponse({"summary": answer["choices"][0]["message"]["content"]})


async def ticker(request: Request) -> StreamingResponse:
    """A streaming route of the app's own: it must pass through the middleware untouched."""

    async def count() -> object:
        for i in range(5):
            yield f"tick {i}\n".encode()

    return StreamingResponse(count(), media_type="text/plain")


def create_app(config: str) -> Starlette:
    app = Starlette(
        routes=[
            Route("/", hello),
            Route("/summarize", summarize, methods=["POST"]),
            Route("/ticker", ticker),
        ]
    )
    app.add_middleware(PromptLBMiddleware, config=config)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=os.environ.get("PROMPTLB_CONFIG", "promptlb.toml"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    serve(create_app(args.config), args.host, args.port, name="example-app", log_level="warning")


if __name__ == "__main__":
    main()
