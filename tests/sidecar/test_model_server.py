"""The model server as the sidecar sees it: what a failed probe says about the server."""

from __future__ import annotations

import socket
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from promptlb.sidecar._model_server import probe


class _NoName(AbstractResolver):
    """A resolver whose lookups fail as a DNS outage's do, without asking any DNS server."""

    async def resolve(
        self, host: str, port: int = 0, family: Any = socket.AF_INET
    ) -> list[ResolveResult]:
        raise OSError(socket.EAI_NONAME, "Name or service not known")

    async def close(self) -> None:
        pass


async def test_a_refused_connection_is_a_server_gone(refused_port: int) -> None:
    async with aiohttp.ClientSession() as session:
        result = await probe(session, f"http://127.0.0.1:{refused_port}", 2.0)
    assert not result.ok and result.gone


async def test_a_failed_lookup_is_no_server_gone() -> None:
    # A DNS blip says nothing of the server: it waits out unhealthy_after like a timeout,
    # where "gone" made the node unready and cold at once.
    connector = aiohttp.TCPConnector(resolver=_NoName())
    async with aiohttp.ClientSession(connector=connector) as session:
        result = await probe(session, "http://model-svc:8000", 2.0)
    assert not result.ok and not result.gone
    assert "unreachable" in result.reason
