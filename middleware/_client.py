"""The in-app client: ``request.state.promptlb.chat(...)`` routes, retries and degrades exactly
like proxied traffic, without an HTTP hop to ourselves."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ._balancer import Balancer, UnknownModel, Upstream, UpstreamError
from ._proxy import route_request
from ._strategies import NoNodeAvailable

__all__ = ["PromptLBClient", "PromptLBError"]

_JSON = [(b"content-type", b"application/json")]


class PromptLBError(Exception):
    """A node answered with an error (``status`` and the node's ``body``)."""

    def __init__(self, status: int, body: object, node: str | None) -> None:
        super().__init__(f"{status} from {node or 'promptlb'}: {body}")
        self.status = status
        self.body = body
        self.node = node


class PromptLBClient:
    def __init__(self, balancer: Balancer) -> None:
        self._lb = balancer

    async def chat(
        self, *, model: str, messages: list[dict[str, Any]], **params: Any
    ) -> dict[str, Any]:
        return await self._call(
            "/v1/chat/completions", {"model": model, "messages": messages, **params}
        )

    async def completions(
        self, *, model: str, prompt: str | list[str], **params: Any
    ) -> dict[str, Any]:
        return await self._call("/v1/completions", {"model": model, "prompt": prompt, **params})

    async def embeddings(
        self, *, model: str, input: str | list[str], **params: Any
    ) -> dict[str, Any]:
        return await self._call("/v1/embeddings", {"model": model, "input": input, **params})

    def chat_stream(
        self, *, model: str, messages: list[dict[str, Any]], **params: Any
    ) -> AsyncIterator[dict[str, Any]]:
        body = {"model": model, "messages": messages, **params, "stream": True}
        return self._stream("/v1/chat/completions", body)

    def completions_stream(
        self, *, model: str, prompt: str | list[str], **params: Any
    ) -> AsyncIterator[dict[str, Any]]:
        body = {"model": model, "prompt": prompt, **params, "stream": True}
        return self._stream("/v1/completions", body)

    @asynccontextmanager
    async def _open(self, path: str, body: dict[str, Any]) -> AsyncIterator[Upstream]:
        """The balancer's upstream, with its refusals as `PromptLBError`: one type to catch."""
        raw = json.dumps(body).encode()
        try:
            async with self._lb.open(route_request(body, len(raw)), path, raw, _JSON) as up:
                yield up
        except UnknownModel as exc:
            raise PromptLBError(404, str(exc), None) from None
        except NoNodeAvailable as exc:
            raise PromptLBError(503, str(exc), None) from None
        except UpstreamError as exc:
            raise PromptLBError(exc.status, str(exc), None) from None

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._open(path, body) as up:
            data = await up.response.read()
            up.first_byte_at = time.monotonic()
            parsed = json.loads(data) if data else None
            if up.response.status >= 400:
                raise PromptLBError(up.response.status, parsed, up.node.name)
            if not isinstance(parsed, dict):
                raise PromptLBError(502, parsed, up.node.name)
            return parsed

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async with self._open(path, body) as up:
            if up.response.status >= 400:
                raise PromptLBError(up.response.status, await up.response.text(), up.node.name)
            # SSE: events are separated by blank lines; "data: [DONE]" ends the stream.
            async for line in up.response.content:
                if up.first_byte_at is None:
                    up.first_byte_at = time.monotonic()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
