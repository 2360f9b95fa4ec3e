"""``promptlb-gateway``: the middleware in a minimal app, for teams without an app of their own.

Served by uvicorn on uvloop with the httptools parser. Only the balanced routes, ``/v1/models``
and the admin endpoints (the dashboard among them) exist; everything else is 404. SIGHUP reads
the config file again (see `PromptLBMiddleware.reload`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence

import uvicorn
import uvloop
from promptlb.shared import ConfigError, parse_duration
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ._asgi import ASGIApp, Receive, Scope, Send, json_error
from ._middleware import PromptLBMiddleware

__all__ = ["main", "serve", "server_config"]


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    elif scope["type"] == "http":
        await json_error(send, 404, f"no route {scope['path']}", "not_found")


_YOUNG_GC_THRESHOLD = 10_000
HEADER_TIMEOUT = 10.0  # seconds from a connection (or the end of its last answer) to headers
# Seconds a SIGTERM leaves the requests under way (a stream of a long answer takes tens of
# seconds); the listener closes at once. uvicorn's 5 s, hard-coded before, cut them.
GRACEFUL_SHUTDOWN = 30.0

_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
# The bytes of a request's head (its request line and header lines), at most (nginx's
# large_client_header_buffers hold 32 KiB; a chunked body's trailer, the same, read by read):
# uvicorn's httptools protocol keeps
# them all, unbounded, and one connection sending 60 MB of header lines grew the gateway by
# 1.1 GB, its request then served; one header line of 64 MB took the loop 4 s.
MAX_HEAD_BYTES = 64 * 1024
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-length: 0\r\nconnection: close\r\n\r\n"
)


# The rest of a body its answer did not wait for (a 404, an admin 401) gets this many header
# timeouts from its first byte after the answer (40 s by default, as nginx's lingering_time
# of 30 s), then the connection closes: nothing else timed it, and a byte every few seconds of
# a body declared a terabyte long held the connection for good.
_UNREAD_FACTOR = 4


def _guarded(header_timeout: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline on a request's headers.

    uvicorn has no header-read timeout (``timeout_keep_alive`` only runs between requests, and
    any byte disarms it; nothing runs before the first request), so a client sending a header
    line every few seconds holds its connection for as long as it likes (slowloris). Here a
    request's headers must be complete ``header_timeout`` after the connection opened or, on a
    kept-alive one, the request's first byte (before it, uvicorn's keep-alive timeout runs);
    otherwise the client gets a 408 and the connection is closed.
    Bodies are the middleware's to time (``requests.body_timeout``): it is what reads them;
    the rest of one its answer did not read has `_UNREAD_FACTOR` header timeouts."""

    class Guarded(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _unread = False  # the timer is the unread body's, not a request's headers'
        _in_head = True  # the bytes coming are a request's head (its line and headers)
        _head = 0  # ... this many of them so far
        _tail = 0  # bytes in a row past the head that carried no body (a chunked trailer)
        _bodied = False  # the read under way carried body bytes
        _read = 0  # the length of the read under way
        _start = 0  # ... of the read the request under way began in
        _refused = False  # a head past the cap was refused: nothing more is parsed into a request
        _dropped = 0  # bytes dropped since
        _headers = 0  # the request's header lines, before any trailer's
        _headed = False  # the read under way ended a head

        def _arm(self, timeout: float = header_timeout) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout, self._too_slow)

        def _disarm(self) -> None:
            self._unread = False
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            # A pipelined request behind an answer still being written: a 408 would land in
            # the middle of that answer, so the connection just closes; so does one still
            # sending a body that was answered already.
            if cycle is None or (cycle.response_complete and not self._unread):
                self.transport.write(_TIMED_OUT)
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            # Between requests uvicorn's keep-alive timer runs, and any byte cancels it: bare
            # CRLFs begin no message, so a newline every few seconds held a kept-alive
            # connection for good. Bytes while no request is under way start the deadline.
            cycle = self.cycle
            if cycle is None or (cycle.response_complete and not cycle.more_body):
                self._arm()
            elif cycle.response_complete and self._header_timer is None:
                self._unread = True  # the rest of a body its answer did not wait for
                self._arm(header_timeout * _UNREAD_FACTOR)
            if self._refused:
                # A head refused behind answers still being written: what comes after it is
                # dropped, not parsed (uvicorn resumes reading whenever the app waits on the
                # client, and lines piled up unbounded), up to the cap, then the connection
                # closes. Read on, a client that leaves is still seen.
                self._dropped += len(data)
                if self._dropped > MAX_HEAD_BYTES:
                    self.transport.close()
                return
            in_head = self._in_head
            self._read = len(data)
            if in_head:
                self._head += len(data)
            self._bodied = self._headed = False
            super().data_received(data)
            if self._refused:
                return
            # Counted by the read, one addition a read: a head still incomplete past the cap is
            # refused here; one that completes is measured as it does (`on_headers_complete`).
            if in_head:
                if self._in_head and self._head > MAX_HEAD_BYTES:
                    self._head_too_large()
            elif not self._in_head:
                # Past the head, reads that carry no body are a chunked body's trailer lines
                # (kept as headers, unbounded) or chunk sizes: held to the same cap. (Not one
                # that ended a head: pipelined requests after a body's end are none of it.)
                self._tail = 0 if self._bodied or self._headed else self._tail + len(data)
                if self._tail > MAX_HEAD_BYTES:
                    self._head_too_large(pipelined=False)
            elif self._head_size() > MAX_HEAD_BYTES:
                # A head begun in this read after a body's end and not ended: its reads are
                # counted from the next; this one's lines, as parsed.
                self._head_too_large()

        def on_body(self, body: bytes) -> None:
            if self._refused:
                return  # (no request under way to take it)
            self._bodied = True
            super().on_body(body)

        def _head_too_large(self, *, pipelined: bool = True) -> None:
            """431 and close. A head behind answers still being written (``pipelined``)
            waits for them, what the client sends meanwhile dropped (`data_received`): closed
            at once, the requests before it were sent to nodes and their answers thrown away.
            (A trailer too long is the request under way's own: its connection closes at
            once.)"""
            self._disarm()
            # Nothing more parsed into a request: the rest of this read would start requests
            # on a connection that is closing.
            self._refused = True
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if not pipelined:
                pass  # the request's own trailer: answered or not, no second answer to it
            elif cycle is None or cycle.response_complete:
                self.transport.write(_TOO_LARGE)
            else:
                return  # `on_response_complete` answers it once the answers before it are out
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._refused and not self.transport.is_closing():
                cycle = self.cycle
                if not self.pipeline and (cycle is None or cycle.response_complete):
                    self._head_too_large()

        def on_message_begin(self) -> None:
            if self._refused:
                return  # (a request after a refused head, in the same read: not one)
            # The read it began in: with the reads counted since, a bound on its head's size.
            self._start = self._read
            super().on_message_begin()
            if self._unread:  # the next request's headers get a deadline of their own
                self._disarm()
            self._arm()

        def on_headers_complete(self) -> None:
            if self._refused:
                return
            # Measured when the reads it may span could hold more than the cap (a long
            # prompt's first read, nearly always: a sum over its header lines, a microsecond),
            # before the app starts on it. Reads alone could not tell where a head ends in the
            # read that crosses the cap (a body, a pipelined request, blank lines before it),
            # and let heads of up to a read more through.
            if self._head + self._start > MAX_HEAD_BYTES and self._head_size() > MAX_HEAD_BYTES:
                self._head_too_large()
                return
            self._in_head = False
            self._headed = True
            self._headers = len(self.headers)  # those after it, a chunked body's trailer's
            self._disarm()
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            if self._refused:
                return  # (bytes after a refused head: a 400 landed inside the answer before)
            super().send_400_response(msg)

        def _head_size(self) -> int:
            # The request line (its method and version, at most 16 bytes with its spaces and
            # line end), the target and each header line with its colon and line end (the
            # spaces around a value are not counted).
            return len(self.url) + 16 + sum(len(n) + len(v) + 3 for n, v in self.headers)

        def on_message_complete(self) -> None:
            if self._refused:
                return
            if len(self.headers) > self._headers:
                # A chunked body's trailer lines: uvicorn appends them to the request's
                # headers, which the app passed on to the node as headers (injected ones too).
                # ASGI has no trailers: dropped, and held to the cap (those in a read with
                # body bytes were counted nowhere).
                trailer = self.headers[self._headers :]
                del self.headers[self._headers :]
                if sum(len(n) + len(v) + 4 for n, v in trailer) > MAX_HEAD_BYTES:
                    self._head_too_large(pipelined=False)
                    return
            super().on_message_complete()
            self._in_head, self._head, self._tail = True, 0, 0  # next: the next request's head

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Guarded


def serve(
    app: ASGIApp,
    host: str,
    port: int,
    *,
    name: str = "promptlb-gateway",
    log_level: str = "info",
    forwarded_allow_ips: str | None = None,
    header_timeout: float = HEADER_TIMEOUT,
    graceful_shutdown: float = GRACEFUL_SHUTDOWN,
    on_hangup: Callable[[], Awaitable[object]] | None = None,
) -> None:
    """Serve an ASGI app with uvicorn on uvloop; prints ``NAME listening on http://…`` once
    bound (with port 0, the port picked). SIGTERM/SIGINT stop it cleanly: no new connections,
    the requests under way given ``graceful_shutdown`` seconds to finish; SIGHUP runs
    ``on_hangup`` (the gateway's config reload) when given."""
    config = server_config(
        app, host, port, log_level, forwarded_allow_ips, header_timeout, graceful_shutdown
    )
    # SIGHUP's default is to end the process: until `_serve` takes it over, one that comes
    # (a config tool reloading right after a restart) is ignored, not the gateway's end (and
    # `main` ignores it from before the config is read).
    if on_hangup is not None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # uvicorn raises the SIGINT it caught again once it has shut down cleanly: a Ctrl-C ended
    # in a traceback (uvicorn's own `run` takes it the same way).
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(_serve(config, name, on_hangup))


def server_config(
    app: ASGIApp,
    host: str,
    port: int,
    log_level: str,
    forwarded_allow_ips: str | None = None,
    header_timeout: float = HEADER_TIMEOUT,
    graceful_shutdown: float = GRACEFUL_SHUTDOWN,
) -> uvicorn.Config:
    """uvicorn's settings for promptlb's servers (the gateway, the example app, the bench's
    floor): the same stack for all, so that their numbers compare.

    ``X-Forwarded-For`` and ``-Proto`` are believed only from ``forwarded_allow_ips`` (uvicorn's
    syntax: addresses and networks, comma-separated, or ``*``). uvicorn's own default trusts
    127.0.0.1, so any local client could claim an address in ``trusted_networks``.
    """
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level=log_level,
        access_log=False,
        loop="none",
        # The C parser, named rather than left to "auto": auto quietly takes h11 when httptools
        # is missing, and the hop then costs half again as much CPU. Guarded: headers must
        # arrive within ``header_timeout``.
        http=_guarded(header_timeout),
        # No WebSocket routes: uvicorn's WebSocket handling stays off whatever is installed
        # (with a WebSocket library, "auto" took an upgrade on a refused head, and raised).
        ws="none",
        proxy_headers=forwarded_allow_ips is not None,
        forwarded_allow_ips=forwarded_allow_ips,
        timeout_graceful_shutdown=math.ceil(graceful_shutdown),  # uvicorn takes whole seconds
    )


def _settle_heap() -> None:
    """Once the server is up: out of the collector's way with what startup built, and young
    collections sized for a busy server's live set."""
    # Everything built so far (modules, the app, its config and node table) lives as long
    # as the server: out of the collector's way, a full collection walks only what
    # requests allocate.
    gc.freeze()
    # A young collection starts every 700 net allocations by default, and what a few
    # dozen requests in flight hold alive crosses that again and again: ~1 collection per
    # 15 requests, 11-14 us a request of the gateway's under wrk, for objects that
    # refcounting frees a moment later.
    # Past the live set of a busy server, collections come when garbage does (cycles).
    gc.set_threshold(_YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


async def _serve(
    config: uvicorn.Config, name: str, on_hangup: Callable[[], Awaitable[object]] | None = None
) -> None:
    host, port = config.host, config.port
    server = uvicorn.Server(config)
    hangups: set[asyncio.Future[object]] = set()
    if on_hangup is not None:
        # uvicorn handles SIGINT and SIGTERM only; SIGHUP, by convention "read your config
        # again", is ours. Each signal is one reload task (the middleware runs them in turn).
        def hangup() -> None:
            task = asyncio.ensure_future(on_hangup())
            hangups.add(task)
            task.add_done_callback(hangups.discard)

        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, hangup)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        _settle_heap()
        bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
        shown = f"[{host}]" if ":" in host else host
        print(f"{name} listening on http://{shown}:{bound}", flush=True)

    announcer = asyncio.create_task(announce())
    try:
        await server.serve()
    finally:
        announcer.cancel()
    if not server.started:
        raise SystemExit(1)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's text as written, and each option's default (where it listens above all),
    but for those that have none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="promptlb-gateway", description=__doc__, formatter_class=_Help
    )
    parser.add_argument("--config", required=True, help="the promptlb TOML file")
    parser.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every one)"
    )
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    parser.add_argument(  # either case, as the sidecar's and the emulator's
        "--log-level",
        default="info",
        type=str.lower,
        choices=["debug", "info", "warning", "error"],
        help="promptlb's and uvicorn's",
    )
    parser.add_argument(
        "--forwarded-allow-ips",
        default=None,
        help="proxies whose X-Forwarded-For is believed (comma-separated, or '*'); default none",
    )
    parser.add_argument(
        "--header-timeout",
        default=f"{HEADER_TIMEOUT:g}s",
        help="a request's headers must be in this long after the connection opened or (kept "
        "alive) its first byte (else 408 and the connection closes); bodies: "
        "requests.body_timeout",
    )
    parser.add_argument(
        "--graceful-shutdown",
        default=f"{GRACEFUL_SHUTDOWN:g}s",
        help="on SIGTERM the listener closes and the requests under way get this long to "
        "finish (keep the pod's terminationGracePeriodSeconds above it)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    # SIGHUP's default ends the process: from here (the config read and the middleware built)
    # until `_serve` takes it over, one is ignored. (One during the imports before this, about
    # half a second, still ends it.)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    parser = _parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"argument --port: got {args.port}, expected a TCP port in 0..65535")
    header_timeout = _duration(parser, "--header-timeout", args.header_timeout)
    # 0: stop at once, the requests under way cut (a restart that must not wait).
    graceful_shutdown = _duration(parser, "--graceful-shutdown", args.graceful_shutdown, zero=True)
    # promptlb's own lines (ejections and returns, health changes, reloads) at the chosen
    # level; uvicorn configures only its own loggers.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("promptlb")
    logger.addHandler(handler)
    logger.setLevel(args.log_level.upper())
    try:
        app = PromptLBMiddleware(_not_found, config=args.config)
    except ConfigError as exc:
        print(f"promptlb-gateway: bad config {args.config}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    serve(
        app,
        args.host,
        args.port,
        log_level=args.log_level,
        forwarded_allow_ips=args.forwarded_allow_ips,
        header_timeout=header_timeout,
        graceful_shutdown=graceful_shutdown,
        on_hangup=app.reload,
    )


def _duration(
    parser: argparse.ArgumentParser, flag: str, value: str, *, zero: bool = False
) -> float:
    """A duration flag's seconds (> 0, or >= 0 with ``zero``), or the parser's error naming
    it."""
    try:
        seconds = parse_duration(flag, value)
    except ConfigError as exc:
        parser.error(f"argument {exc}")
    if seconds < 0 or (seconds == 0 and not zero):
        parser.error(f"argument {flag}: got {value}, expected {'>= 0' if zero else '> 0'}")
    return seconds
