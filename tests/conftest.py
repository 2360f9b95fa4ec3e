"""Fixtures shared by every test folder."""

from __future__ import annotations

import asyncio
import faulthandler
import os
import shutil
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import settings
from promptlb.emulator import Service, start_redis, start_service

Launcher = Callable[..., Service]
Serve = Callable[[web.Application], AbstractAsyncContextManager[str]]

__all__ = ["Launcher", "RedisServer", "Serve", "Service", "eventually", "sidecar_args"]


# No per-example deadline for any property test: one scheduling stall on a loaded 2-core CI
# machine fails hypothesis's default 200 ms (most tests already said so one by one).
settings.register_profile("promptlb", deadline=None)
settings.load_profile("promptlb")

# Far past the slowest test (a cluster run, about a minute on a loaded machine): a test that
# hangs (code that stops cancelling what it should) ends the run with every thread's stack
# instead of holding CI until its own timeout. faulthandler is the standard library's: no
# plugin needed.
HANG_S = 600


@pytest.fixture(autouse=True)
def _no_hang(request: pytest.FixtureRequest) -> Iterator[None]:
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=_terminal(request))
    yield
    faulthandler.cancel_dump_traceback_later()


_TERMINAL: list[Any] = []  # opened once per run


def _terminal(request: pytest.FixtureRequest) -> Any:
    """The terminal's stderr, not the capture's file (lost when the process exits)."""
    if not _TERMINAL:
        capman = request.config.pluginmanager.getplugin("capturemanager")
        capturing = getattr(capman, "_global_capturing", None)
        saved = getattr(getattr(capturing, "err", None), "targetfd_save", None)
        out = os.fdopen(os.dup(saved), "w") if isinstance(saved, int) else sys.__stderr__
        _TERMINAL.append(out)
    return _TERMINAL[0]


def sidecar_args(model_url: str, name: str, *extra: str) -> tuple[str, ...]:
    """A test sidecar's flags: beside ``model_url`` as node ``name``, sampling every 100 ms,
    ready without a warmup, quiet."""
    return (
        "--model-url",
        model_url,
        "--node-name",
        name,
        "--sample-interval",
        "100ms",
        "--no-warmup-required",
        "--log-level",
        "WARNING",
        *extra,
    )


@pytest.fixture
def launch() -> Iterator[Launcher]:
    """``launch("emulator", "--slots", "2")`` starts a real process; teardown stops them all."""
    started: list[Service] = []

    def _launch(module: str, *args: str, timeout: float = 20.0) -> Service:
        service = start_service(module, *args, timeout=timeout)
        started.append(service)
        return service

    yield _launch
    for service in reversed(started):
        service.stop()


async def eventually(check: Callable[[], Awaitable[bool]], limit: float = 10.0) -> None:
    """Wait until ``check()`` holds, asking every 50 ms; fails the test after ``limit`` s.
    For what happens in the background (a cache write, a request reaching its node): a fixed
    sleep before the assert is a race on a loaded machine."""
    async with asyncio.timeout(limit):
        while not await check():  # noqa: ASYNC110 (a condition no event of ours signals)
            await asyncio.sleep(0.05)


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port whose connects are refused for the whole test: bound, never listening
    (a port let go after a probe could be taken by another process before it was used)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


@pytest.fixture
def serve() -> Serve:
    """``async with serve(app) as url:`` runs an aiohttp app on a free loopback port; the
    block's end cleans it up."""

    @asynccontextmanager
    async def _serve(app: web.Application) -> AsyncIterator[str]:
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()

    return _serve


class RedisServer:
    """A real ``redis-server`` on a random loopback port, in its own directory."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.service = start_redis(binary, str(workdir))
        self.port = self.service.port
        self.url = self.service.url
        self.proc = self.service.proc

    def kill(self) -> None:
        """SIGKILL: Redis dies as it would on a crash (idempotent)."""
        self.service.kill()


def need_binary(name: str, package: str) -> str:
    """The binary's path; missing, a skip, or under ``CI=true`` a failure (.ci/run installs it)."""
    binary = shutil.which(name)
    if binary is None:
        message = f"{name} is not installed (apt-get install {package})"
        if os.environ.get("CI") == "true":
            pytest.fail(message + ": CI must install it (.ci/run)")
        pytest.skip(message)
    return binary


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    binary = need_binary("redis-server", "redis-server")
    server = RedisServer(binary, tmp_path)
    try:
        yield server
    finally:
        server.kill()
        server.service.stop()  # its log file
