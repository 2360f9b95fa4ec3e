"""Running an aiohttp app from a CLI: uvloop, a listening line, clean SIGTERM/SIGINT shutdown.

Needs aiohttp and uvloop, so it is not imported by ``promptlb.shared`` itself: only the tools that
serve HTTP (sidecar, emulator) import it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

import uvloop
from aiohttp import web

from ._config import ConfigError

__all__ = ["config_or_exit", "serve"]

T = TypeVar("T")
SHUTDOWN_TIMEOUT_S = 2.0


def config_or_exit(parser: argparse.ArgumentParser, build: Callable[[], T]) -> T:
    """Build a config; a bad value exits 2 with a message naming the flag, as argparse does."""
    try:
        return build()
    except ConfigError as exc:
        flag = "--" + exc.key.replace("_", "-")
        parser.error(f"argument {flag}: got {exc.value!r}, expected {exc.expected}")


async def _serve(app: web.Application, host: str, port: int, name: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # handler_cancellation: a client that goes away cancels its handler, so work stops with it.
    # shutdown_timeout: aiohttp's default waits 60 s (twice) for in-flight handlers; a hung
    # request would keep a stopped service alive for two minutes.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    try:
        # A deep backlog: a burst of hundreds of connects must not overflow into SYN retries.
        site = web.TCPSite(runner, host, port, backlog=4096)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        # Tests and scripts wait for this line; with --port 0 it is how they learn the port.
        shown = f"[{host}]" if ":" in host else host
        print(f"{name} listening on http://{shown}:{bound}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def serve(app: web.Application, host: str, port: int, name: str) -> None:
    try:
        uvloop.run(_serve(app, host, port, name))
    except OSError as exc:
        print(f"{name}: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        raise SystemExit(1) from None
