"""What counts against a node and what does not, on real processes: emulators, sidecars and the
middleware on uvicorn (the example app, and the gateway for the slow clients)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
import pytest
from aiohttp import web
from promptlb.middleware import PromptLBMiddleware

from tests.conftest import Launcher, Serve, Service
from tests.middleware.conftest import Flags, MakeCluster, Messages, chat_node

HEALTH = "[health]\ninterval = '300ms'\ninterval_jitter = '50ms'\ntimeout = '300ms'\n"
# Two failures in a row eject: what the old rules did to a node for a poison request or two.
TOUCHY = "strategy = 'round_robin'\n[outlier]\nconsecutive_failures = 2\n"


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    async with http.post(url + "/v1/chat/completions", json=body) as response:
        return response.status, await response.json(), response.headers


async def nodes_answering(
    http: aiohttp.ClientSession, url: str, hello: Messages, n: int
) -> set[str]:
    """The nodes that answered ``n`` short chats, every one of which must succeed."""
    seen = set()
    for _ in range(n):
        status, _, headers = await post(
            http, url, {"model": "m", "messages": hello, "max_tokens": 2}
        )
        assert status == 200
        seen.add(headers["x-promptlb-node"])
    return seen


async def emulator_requests(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/_emulator/stats") as response:
        stats: dict[str, Any] = await response.json()
        return int(stats["requests"])


async def test_the_issue_probes_eject_no_node(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    poison = ("nosidecar", "--poison", "POISON", *fast)
    c = cluster({"a": poison, "b": poison, "c": poison}, TOUCHY)
    async with aiohttp.ClientSession() as http:
        # A lone surrogate and an absurd max_tokens are refused before any node sees them.
        lone = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'
        for _ in range(6):
            async with http.post(
                c.app.url + "/v1/chat/completions",
                data=lone,
                headers={"content-type": "application/json"},
            ) as response:
                assert response.status == 400
                assert (await response.json())["error"]["param"] == "messages[0].content"
            status, body, _ = await post(
                http, c.app.url, {"model": "m", "messages": hello, "max_tokens": 10**12}
            )
            assert (status, body["error"]["param"]) == (400, "max_tokens")
        for node in c.nodes.values():
            assert await emulator_requests(http, node.model.url) == 0
        # A request every node fails alike (500) is the request's fault: two tries, no more,
        # and no node is blamed for it.
        for _ in range(8):
            status, body, headers = await post(
                http,
                c.app.url,
                {"model": "m", "messages": [{"role": "user", "content": "POISON"}]},
            )
            assert status == 500
            assert body["error"]["message"] == "emulated crash on a poison request"
            assert headers["x-promptlb-attempts"] == "2"
        nodes = (await c.status())["nodes"]
        assert [n["state"] for n in nodes] == ["ready"] * 3
        assert [n["failures"] for n in nodes] == [0, 0, 0]
        assert [n["times_ejected"] for n in nodes] == [0, 0, 0]
        assert sum(n["request_faults"] for n in nodes) == 16
        assert all(n["error_rate"] == 0 for n in nodes)
        # The healthy requests still go everywhere.
        assert await nodes_answering(http, c.app.url, hello, 6) == {"a", "b", "c"}


async def test_a_broken_node_still_counts_when_the_request_succeeds_elsewhere(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    c = cluster(
        {"bad": ("nosidecar", "--error-rate", "1", *fast), "good": ("nosidecar", *fast)},
        TOUCHY,
    )
    async with aiohttp.ClientSession() as http:
        for _ in range(4):
            status, _, headers = await post(
                http, c.app.url, {"model": "m", "messages": hello, "max_tokens": 2}
            )
            assert (status, headers["x-promptlb-node"]) == (200, "good")
    bad = next(n for n in (await c.status())["nodes"] if n["name"] == "bad")
    assert bad["times_ejected"] == 1  # its 500s were its own: the next node answered
    assert bad["request_faults"] == 0


async def test_a_timeout_explained_by_max_tokens_is_not_the_nodes(
    cluster: MakeCluster, hello: Messages
) -> None:
    # 50 tokens a second: 2,000 tokens take 40 s, and a try is given 500 ms.
    slow = ("nosidecar", "--ttft-ms", "10", "--tokens-per-s", "50")
    config = TOUCHY + "[retry]\nper_try_timeout = '500ms'\ntotal_timeout = '1s'\n"
    c = cluster({"a": slow, "b": slow}, config)
    async with aiohttp.ClientSession() as http:
        for _ in range(4):
            started = time.monotonic()
            status, body, headers = await post(
                http, c.app.url, {"model": "m", "messages": hello, "max_tokens": 2000}
            )
            assert status == 504
            assert time.monotonic() - started < 2  # not retried: no node is faster
            assert headers["x-promptlb-attempts"] == "1"
            assert "max_tokens 2000" in body["error"]["message"]
        # A stream cut at its deadline (1 s) while generating what it asked for: its size.
        body = {"model": "m", "messages": hello, "max_tokens": 2000, "stream": True}
        async with http.post(c.app.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            events = (await response.read()).decode()
        assert "upstream stream ran past its deadline" in events
        # A short request that times out is the node's: 4 tokens take 80 ms at 50/s.
        async with http.post(
            c.nodes["a"].model.url + "/_emulator/faults", json={"hang": True}
        ) as response:
            assert response.status == 200
        for _ in range(4):
            status, _, headers = await post(
                http, c.app.url, {"model": "m", "messages": hello, "max_tokens": 4}
            )
            assert (status, headers["x-promptlb-node"]) == (200, "b")
    nodes = {n["name"]: n for n in (await c.status())["nodes"]}
    assert nodes["b"]["failures"] == 0
    assert nodes["a"]["times_ejected"] == 1  # the hang, not the long requests
    assert nodes["a"]["request_faults"] + nodes["b"]["request_faults"] == 5


async def test_losing_every_sidecar_degrades_routing_never_availability(
    cluster: MakeCluster, fast: Flags, hello: Messages
) -> None:
    c = cluster({"a": fast, "b": fast}, "strategy = 'round_robin'\n" + HEALTH)
    async with aiohttp.ClientSession() as http:
        for node in c.nodes.values():
            assert node.sidecar is not None
            node.sidecar.stop()
        await asyncio.sleep(2.0)  # six health rounds, and every snapshot stale (5 s) soon after
        assert await nodes_answering(http, c.app.url, hello, 10) == {"a", "b"}
        states = [n["state"] for n in (await c.status())["nodes"]]
        assert states == ["ready", "ready"]
        # Its model server gone too, a node leaves: the direct check is a real check.
        c.nodes["a"].model.stop()
        deadline = time.monotonic() + 10
        while (states := [n["state"] for n in (await c.status())["nodes"]])[0] == "ready":
            assert time.monotonic() < deadline, states
            await asyncio.sleep(0.1)
        assert states == ["unhealthy", "ready"]


@pytest.fixture(autouse=True)
def _sighup_kept() -> Iterator[None]:
    """The gateway's `main`, called in process here, ignores SIGHUP from its start: this
    process's own disposition is put back after each test."""
    previous = signal.getsignal(signal.SIGHUP)
    yield
    signal.signal(signal.SIGHUP, previous)


def _gateway_config(tmp_path: Path, model_url: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(
        "[requests]\nbody_timeout = '1s'\n"
        f"[[nodes]]\nname = 'a'\nurl = '{model_url}'\nmodels = ['m']\n"
    )
    return path


def _slow_client(port: int, head: bytes, drip: bytes) -> tuple[float, bytes]:
    """Sends ``head``, then ``drip`` every 0.5 s until answered; the seconds until the server
    answered or closed, and what it answered. Blocking: run it in a thread."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(head)
        sock.settimeout(0.5)
        answer = b""
        for _ in range(40):
            try:
                answer = sock.recv(65536)
                break  # an answer, or b"": the server closed the connection
            except TimeoutError:
                pass
            try:
                sock.sendall(drip)
            except OSError:
                break
        took = time.monotonic() - started
        sock.settimeout(5)
        while answer:
            try:
                more = sock.recv(65536)
            except OSError:
                break
            if not more:
                break
            answer += more
        return took, answer


SLOW_HEADERS = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"  # never the blank line
SLOW_BODY = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 100\r\n\r\n{"
)


async def test_slow_clients_are_cut_off_while_others_are_served(
    launch: Launcher, tmp_path: Path, fast: Flags, hello: Messages
) -> None:
    model = launch("emulator", "--model", "m", *fast)
    config = _gateway_config(tmp_path, model.url)
    gateway = launch("middleware", "--config", str(config), "--header-timeout", "1s")
    port = gateway.port
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=15)  # every slow client at once

    def start(head: bytes, drip: bytes) -> asyncio.Future[tuple[float, bytes]]:
        return loop.run_in_executor(pool, _slow_client, port, head, drip)

    try:
        slow = [start(SLOW_HEADERS, b"x-slow: 1\r\n") for _ in range(10)]
        slow_bodies = [start(SLOW_BODY, b" ") for _ in range(5)]
        served = 0
        async with aiohttp.ClientSession() as http:
            started = time.monotonic()
            while time.monotonic() - started < 2.5:
                status, _, _ = await post(
                    http, gateway.url, {"model": "m", "messages": hello, "max_tokens": 2}
                )
                assert status == 200
                served += 1
        header_results = await asyncio.gather(*slow)
        body_results = await asyncio.gather(*slow_bodies)
    finally:  # a failed assert above left its threads to the interpreter's exit
        pool.shutdown(wait=False, cancel_futures=True)
    assert served > 5
    # Cut off at the deadline (1 s), although each sent something every 0.5 s (uncut, a
    # client drips for 20 s); the upper bound leaves room for a loaded machine.
    for took, answer in header_results:
        assert 0.9 < took < 4.0, took
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    for took, answer in body_results:
        assert 0.9 < took < 4.0, took
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == 408


_POST_ELSEWHERE = b"POST /elsewhere HTTP/1.1\r\nHost: x\r\n"  # a route the gateway answers 404


@contextlib.contextmanager
def _answered(gateway: Service, request: bytes, status: bytes) -> Iterator[socket.socket]:
    """A raw connection to ``gateway`` that sent ``request`` and read the start of its answer,
    which has ``status``; what the test does next is on the open connection."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as conn:
        conn.sendall(request)
        conn.settimeout(2)
        answer = conn.recv(65536)
        assert answer.startswith(b"HTTP/1.1 " + status), answer[:100]
        yield conn


def _chat(max_tokens: int) -> tuple[bytes, bytes]:
    """A chat completion as raw bytes: its head (with its length) and its body."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %d}'
    body %= max_tokens
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
    return head + b"\r\nContent-Length: %d\r\n\r\n" % len(body), body


def _slow_gateway(launch: Launcher, tmp_path: Path, tokens_per_s: int) -> Service:
    """A gateway before one emulated node that answers ``tokens_per_s`` tokens a second."""
    speed = ("--tokens-per-s", str(tokens_per_s), "--output-spread", "0")
    model = launch("emulator", "--model", "m", *speed)
    return launch("middleware", "--config", str(_gateway_config(tmp_path, model.url)))


def _guarded_gateway(launch: Launcher, tmp_path: Path) -> Service:
    """A gateway before one emulated node, its header deadline at 500 ms."""
    model = launch("emulator", "--model", "m")
    config = _gateway_config(tmp_path, model.url)
    return launch("middleware", "--config", str(config), "--header-timeout", "500ms")


async def test_a_connection_that_sends_nothing_is_closed(launch: Launcher, tmp_path: Path) -> None:
    gateway = _guarded_gateway(launch, tmp_path)
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as idle:
        started = time.monotonic()
        assert idle.recv(1024).startswith(b"HTTP/1.1 408")
        assert idle.recv(1024) == b""
        assert time.monotonic() - started < 2


_TOO_LARGE_ANSWER = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-length: 0\r\nconnection: close\r\n\r\n"
)


async def test_headers_past_their_size_limit_are_refused_and_kept_by_no_one(
    launch: Launcher, tmp_path: Path
) -> None:
    # uvicorn keeps every header line: 60 MB of them, sent quickly, grew the gateway by a
    # gigabyte and the request was served. Past MAX_HEAD_BYTES: a 431 and the connection shut;
    # a request with headers under it is served as before.
    gateway = _guarded_gateway(launch, tmp_path)

    def flood(line: bytes, start: bytes = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n") -> bytes:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as conn:
            conn.sendall(start)
            with contextlib.suppress(OSError):  # closed on us part way: the point
                for _ in range(2_000):  # 2 MB, never the end of the headers
                    conn.sendall(line)
            heard = b""
            try:
                while chunk := conn.recv(65536):
                    heard += chunk
            except TimeoutError:  # never closed on us
                return b"(still open)"
            except OSError:
                pass
            return heard

    # Many lines, and one line never ended (the parser grew it, read by read, quadratically).
    for line in (b"X-Filler: " + b"y" * 990 + b"\r\n", b"y" * 1000):
        heard = await asyncio.to_thread(flood, line)
        assert heard.startswith(b"HTTP/1.1 431"), heard[:200]
    # A chunked body's trailer lines, after its last chunk: kept as headers too.
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
    )
    for line in (b"X-T: " + b"y" * 995 + b"\r\n", b"y" * 1000):
        heard = await asyncio.to_thread(flood, line, chunked)
        assert heard == b"", heard[:200]  # closed on it (its answer under way: no 431 in it)
    rss = psutil.Process(gateway.pid).memory_info().rss
    assert rss < 400 << 20, rss  # (a gigabyte per connection before)
    big_but_fine = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"y" * 30_000
    with _answered(gateway, big_but_fine + b"\r\n\r\n", b"200"):
        pass
    # A whole head past the cap, sent at once: judged by reads alone, one ending in the read
    # that crossed the cap was served (a single header of up to about 120 KB).
    # And one behind blank lines (the parser skips them; a search for the head's end did not).
    for size in (70_000, 120_000):
        whole = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"y" * size + b"\r\n\r\n"
        for sent in (whole, b"\r\n\r\n" + whole):
            heard = await asyncio.to_thread(flood, b"", sent)
            assert heard.startswith(b"HTTP/1.1 431"), (size, heard[:200])
    # One behind a request still being answered (pipelined): that answer first, then the 431
    # (the connection was closed at once, the answer the node gave thrown away).
    first = b"".join(_chat(20))
    big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"y" * 70_000 + b"\r\n\r\n"
    heard = await asyncio.to_thread(flood, b"", first + big)
    assert heard.startswith(b"HTTP/1.1 200") and b'"choices"' in heard, heard[:300]
    assert heard.endswith(_TOO_LARGE_ANSWER), heard[-300:]
    # A head under the cap with a body past it in the same reads: taken, and passed on (the
    # node refuses a header line that long itself: its 400, not the gateway's 431).
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"z" * 100_000 + b'"}]}'
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"X-Filler: " + b"y" * 60_000 + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as conn:
        conn.sendall(head + body)
        answer = conn.recv(65536)
    assert b"\r\nx-promptlb-node: " in answer, answer[:200]
    # A small head whose blank line is split across two reads, the body with its second half.
    small = head.replace(b"y" * 60_000, b"y")

    def split(cut: int) -> bytes:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=1) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(small[: len(small) - cut])
            time.sleep(0.1)
            conn.sendall(small[len(small) - cut :] + body)
            return _drain(conn)  # kept alive: until the timeout

    # (0: the head whole, its body of 100 KB in the reads after: a version that counted a
    # body's last read as the next head's refused the next request that never came.)
    for cut in (0, 1, 2, 3):
        answer = await asyncio.to_thread(split, cut)
        assert b"\r\nx-promptlb-node: " in answer, (cut, answer[:200])
        assert b"431" not in answer, (cut, answer[-200:])


async def test_what_follows_a_head_refused_behind_an_answer_is_dropped_not_kept(
    launch: Launcher, tmp_path: Path
) -> None:
    # Its 431 waits for the answer before it (6 s here). Paused, reading was resumed by
    # uvicorn as the app read its body: header lines kept coming, parsed and kept, 2 GB in 8 s.
    gateway = _slow_gateway(launch, tmp_path, 5)
    first = b"".join(_chat(30))
    # (Past the cap within the same send: refused before the app has read its body.)
    big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"y" * 300_000 + b"\r\n"
    rss = psutil.Process(gateway.pid).memory_info().rss

    def pile() -> int:
        accepted = 0
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=0.5) as conn:
            conn.sendall(first + big)
            time.sleep(0.3)
            lines = (b"X-More: " + b"z" * 1014 + b"\r\n") * 64
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                try:
                    accepted += conn.send(lines)
                except TimeoutError:
                    continue
                except OSError:
                    break  # closed on us: the point
        return accepted

    accepted = await asyncio.to_thread(pile)
    assert accepted < 8 << 20, accepted  # (hundreds of megabytes before, and growing)
    assert psutil.Process(gateway.pid).memory_info().rss < rss + (50 << 20)


def _raw(port: int, sent: bytes, wait: float = 3.0) -> bytes:
    """``sent`` on a raw connection; all the server answers until it closes or ``wait``."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as conn:
        conn.sendall(sent)
        return _drain(conn)


def _drain(conn: socket.socket) -> bytes:
    """All the server sends on ``conn`` until it closes or the socket's timeout passes."""
    heard = b""
    with contextlib.suppress(OSError):
        while chunk := conn.recv(65536):
            heard += chunk
    return heard


async def test_a_chunked_bodys_trailer_reaches_no_node_as_headers(
    launch: Launcher, serve: Serve, tmp_path: Path
) -> None:
    # uvicorn appends trailer lines to the request's headers, which the gateway passed on: a
    # client could add headers after the body (and, in the body's read, past any cap).
    seen: list[list[str]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append([name.lower() for name in request.headers])
        return web.json_response({"id": "x", "choices": [{"index": 0, "text": "ok"}]})

    async with serve(chat_node(chat)) as url:
        # (No health checks: this loop, where the node answers, waits while the gateway starts.)
        config = _gateway_config(tmp_path, url)
        config.write_text("[health]\nenabled = false\n" + config.read_text())
        gateway = launch("middleware", "--config", str(config))
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n" % (len(body), body)
        )
        heard = await asyncio.to_thread(_raw, gateway.port, head + b"X-Injected: 1\r\n\r\n")
        assert heard.startswith(b"HTTP/1.1 200"), heard[:200]
        assert seen and "x-injected" not in seen[-1], seen
        count = len(seen)
        long = head + b"X-T: " + b"y" * 100_000 + b"\r\n\r\n"  # with the body, in one send
        heard = await asyncio.to_thread(_raw, gateway.port, long)
        assert heard == b"" and len(seen) == count, heard[:200]  # closed; no node asked


async def test_requests_pipelined_after_a_chunked_bodys_end_are_no_trailer(
    launch: Launcher, tmp_path: Path
) -> None:
    # A read that began in a chunked body and carried none of it counted whole as trailer
    # lines: 110 small requests pipelined after the body's end passed 64 KiB, and the
    # connection closed on them unanswered.
    gateway = _guarded_gateway(launch, tmp_path)
    last, body = _chat(1)
    start = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(body), body)
    )
    gets = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-F: " + b"y" * 600 + b"\r\n\r\n"

    def send() -> bytes:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=2) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(start)
            time.sleep(0.1)
            # ... and the read ends inside the last one's body (sent a moment later)
            conn.sendall(b"0\r\n\r\n" + gets * 110 + last)
            time.sleep(0.2)
            conn.sendall(body)
            return _drain(conn)

    heard = await asyncio.to_thread(send)
    assert heard.count(b"HTTP/1.1 200") == 112, heard[-300:]


async def test_a_trailer_too_long_after_its_answer_gets_no_second_answer(
    launch: Launcher, tmp_path: Path
) -> None:
    # Answered without its body (a route nobody serves), the request's trailer past the cap
    # got a 431 after that answer: two answers to one request.
    gateway = _guarded_gateway(launch, tmp_path)
    start = b"POST /nowhere HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n"

    def send() -> bytes:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=2) as conn:
            conn.sendall(start)
            time.sleep(0.3)  # answered meanwhile
            with contextlib.suppress(OSError):  # (closed on us part way: the answer stands)
                conn.sendall(b"0\r\nX-T: " + b"y" * 100_000 + b"\r\n\r\n")
            return _drain(conn)

    heard = await asyncio.to_thread(send)
    assert heard.startswith(b"HTTP/1.1 404") and b"431" not in heard, heard[-300:]


async def test_bytes_after_a_refused_head_put_nothing_inside_the_answer_before_it(
    launch: Launcher, tmp_path: Path
) -> None:
    # The rest of the read was still parsed: a malformed line after the refused head made
    # uvicorn write its 400 into the stream under way, and cut it.
    gateway = _slow_gateway(launch, tmp_path, 20)
    first = b"".join(_chat(10))
    big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-F: " + b"y" * 70_000 + b"\r\n\r\n"
    bad = b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"
    heard = await asyncio.to_thread(_raw, gateway.port, first + big + bad)
    assert heard.startswith(b"HTTP/1.1 200") and b"400 Bad Request" not in heard, heard[-300:]
    assert heard.endswith(_TOO_LARGE_ANSWER), heard[-300:]


async def test_bare_newlines_between_requests_do_not_hold_a_connection(
    launch: Launcher, tmp_path: Path
) -> None:
    # Each byte cancels uvicorn's keep-alive timer, and a CRLF begins no request: a newline
    # every 0.2 s held a kept-alive connection for as long as the client liked.
    gateway = _guarded_gateway(launch, tmp_path)

    def trickle() -> float:
        with _answered(gateway, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", b"200") as conn:
            started = time.monotonic()
            while time.monotonic() - started < 4:
                try:
                    conn.sendall(b"\r\n")
                    time.sleep(0.2)
                except OSError:
                    break  # closed on us
            took = time.monotonic() - started
            conn.settimeout(1)
            rest = _drain(conn)  # the models body, then the 408
            assert b"HTTP/1.1 408" in rest, rest
            return took

    took = await asyncio.to_thread(trickle)
    assert took < 3, took


async def test_the_rest_of_a_body_answered_early_is_not_cut_as_slow_headers(
    launch: Launcher, tmp_path: Path
) -> None:
    # A route that answers without reading the body (the gateway's 404): the upload goes on,
    # and its bytes are not the next request's headers to time.
    gateway = _guarded_gateway(launch, tmp_path)

    def upload() -> bytes:
        with _answered(
            gateway, _POST_ELSEWHERE + b"Content-Length: 100000\r\n\r\n", b"404"
        ) as conn:
            conn.settimeout(0.05)
            heard = b""
            started = time.monotonic()
            while time.monotonic() - started < 1.5:  # three header timeouts
                conn.sendall(b"x" * 100)
                with contextlib.suppress(TimeoutError, OSError):
                    heard += conn.recv(65536)
                time.sleep(0.1)
            return heard

    heard = await asyncio.to_thread(upload)
    assert b"408" not in heard, heard[:200]


async def test_the_rest_of_a_body_answered_early_cannot_hold_the_connection_for_good(
    launch: Launcher, tmp_path: Path
) -> None:
    # Nothing timed it: a byte every few seconds of a body declared a terabyte long held the
    # connection for as long as the client liked. It has four header timeouts (here 2 s).
    gateway = _guarded_gateway(launch, tmp_path)

    def upload() -> float:
        declared = b"Content-Length: 1000000000000\r\n\r\n"
        with _answered(gateway, _POST_ELSEWHERE + declared, b"404") as conn:
            started = time.monotonic()
            while time.monotonic() - started < 8:
                try:
                    conn.sendall(b"x")
                except OSError:
                    break  # closed on us
                conn.settimeout(0.25)
                try:
                    if conn.recv(65536) == b"":
                        break
                except TimeoutError:
                    pass
            return time.monotonic() - started

    took = await asyncio.to_thread(upload)
    assert 1.5 < took < 7, took  # 2 s, with room for a loaded machine (the loop gives up at 8)


async def test_the_request_after_an_unread_body_gets_its_own_header_deadline(
    launch: Launcher, tmp_path: Path
) -> None:
    # The unread body's longer deadline ran on into the next request's headers: no 408 at the
    # header timeout, and a close without one when the longer deadline ran out.
    gateway = _guarded_gateway(launch, tmp_path)

    def next_request() -> bytes:
        with _answered(gateway, _POST_ELSEWHERE + b"Content-Length: 10\r\n\r\n", b"404") as conn:
            conn.sendall(b"x" * 10)  # the body, after its answer
            time.sleep(0.3)
            conn.sendall(b"G")  # the next request's first byte, and no more
            conn.settimeout(1.5)  # three header timeouts, under the body's four
            return _drain(conn)  # the 404's body, if it came apart, and the 408

    heard = await asyncio.to_thread(next_request)
    assert b"HTTP/1.1 408" in heard, heard[:200]


def test_the_gateway_refuses_a_bad_header_timeout() -> None:
    from promptlb.middleware._gateway import main

    with pytest.raises(SystemExit):
        main(["--config", "x.toml", "--header-timeout", "soon"])


async def test_a_client_too_slow_to_take_a_stream_is_not_the_nodes_failure(
    launch: Launcher,
) -> None:
    # The answer's deadline passes while the client holds a send back: the stream ends, and
    # the node, which sent everything in time, is not charged with a failure.
    model = launch("emulator", "--model", "m", "--ttft-ms", "5", "--tokens-per-s", "200")

    async def app_behind(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("balanced routes do not reach the app")

    app = PromptLBMiddleware(
        app_behind,
        config={
            "retry": {"total_timeout": "1s"},
            "nodes": [{"name": "a", "url": model.url, "models": ["m"]}],
        },
    )
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "x"}],
    }
    given = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if given:
            return given.pop()
        await asyncio.Event().wait()  # connected, saying nothing
        raise AssertionError("unreachable")

    sent: list[Mapping[str, Any]] = []

    async def send(message: Mapping[str, Any]) -> None:
        sent.append(message)
        if message.get("more_body") and len(sent) >= 3:
            await asyncio.sleep(1.5)  # a client that stopped reading

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
    }
    try:
        await app(scope, receive, send)
        node = app.balancer.table.nodes["a"]
        assert sent[0]["status"] == 200
        assert b"ran past its deadline" in b"".join(m.get("body", b"") for m in sent)
        assert (node.failures, node.consecutive_failures, node.view.error_rate) == (0, 0, 0.0)
        metrics = app.balancer.metrics.render().decode()
        assert 'promptlb_requests_total{node="a",outcome="aborted"} 1.0' in metrics
    finally:
        await app.balancer.stop()


async def test_sigterm_lets_a_long_stream_finish_within_the_graceful_shutdown(
    launch: Launcher, tmp_path: Path, hello: Messages
) -> None:
    """uvicorn's 5 s was hard-coded: a rolling update cut every stream older than that. The
    listener closes at once; the requests under way get ``--graceful-shutdown``."""
    model = launch("emulator", "--model", "m", "--ttft-ms", "5", "--tokens-per-s", "10")
    config = _gateway_config(tmp_path, model.url)
    gateway = launch("middleware", "--config", str(config), "--graceful-shutdown", "10s")
    body = {"model": "m", "messages": hello, "max_tokens": 60, "stream": True}  # ~6 s
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            await response.content.readline()
            gateway.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            with pytest.raises(aiohttp.ClientConnectionError):  # no new connections meanwhile
                await http.get(gateway.url + "/v1/models")
            started = time.monotonic()
            text = (await response.read()).decode()
        assert text.rstrip().endswith("data: [DONE]")  # whole, past uvicorn's 5 s
        assert time.monotonic() - started > 4  # it went on streaming after the signal
    # Done at once after that stream; uvicorn re-raises the signal it caught as it exits.
    assert gateway.proc.wait(timeout=5) in (0, -signal.SIGTERM)


def test_ctrl_c_ends_the_gateway_without_a_traceback(launch: Launcher, tmp_path: Path) -> None:
    # uvicorn raises the SIGINT it caught again after its clean shutdown: a Ctrl-C printed a
    # KeyboardInterrupt traceback.
    model = launch("emulator", "--model", "m", "--ttft-ms", "5")
    gateway = launch("middleware", "--config", str(_gateway_config(tmp_path, model.url)))
    gateway.proc.send_signal(signal.SIGINT)
    assert gateway.proc.wait(timeout=15) == 0
    assert "Traceback" not in gateway.log()


def test_a_sighup_before_the_reload_handler_is_in_place_is_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import uvloop
    from promptlb.middleware import _gateway

    seen: dict[str, object] = {}

    def run(main: Any) -> None:  # what the loop would start with: the signal's disposition
        main.close()
        seen["sighup"] = signal.getsignal(signal.SIGHUP)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not served")

    async def reload() -> None:
        pass

    monkeypatch.setattr(uvloop, "run", run)
    previous = signal.getsignal(signal.SIGHUP)
    try:
        _gateway.serve(app, "127.0.0.1", 0, on_hangup=reload)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert seen["sighup"] == signal.SIG_IGN


def test_the_gateway_refuses_a_bad_graceful_shutdown(capsys: pytest.CaptureFixture[str]) -> None:
    from promptlb.middleware._gateway import main

    for bad in ("soon", "-1s"):
        with pytest.raises(SystemExit):
            main(["--config", "x.toml", "--graceful-shutdown", bad])
        assert "--graceful-shutdown" in capsys.readouterr().err
    # 0: stop at once. Taken; what stops this start is the config file that is not there.
    with pytest.raises(SystemExit):
        main(["--config", "x.toml", "--graceful-shutdown", "0s"])
    err = capsys.readouterr().err
    assert "bad config" in err and "--graceful-shutdown" not in err


@pytest.mark.parametrize("between", ["unreachable", "429"])
async def test_a_5xx_then_another_failure_charges_the_first_node(
    serve: Serve, refused_port: int, between: str
) -> None:
    """A answers 500, B fails otherwise (cannot be reached, or answers 429), C answers the
    same 500: no two tries in a row failed the request alike, so A's 500 was A's (it used to
    stay pending, and C's made both look like the request's fault; behind a 429 until
    2026-12-07)."""
    from aiohttp import web

    async def fail(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "same"}}, status=500)

    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=429)

    async def noop(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not reached")

    def app_of(handler: Any) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        return app

    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(serve(app_of(fail)))
        c = await stack.enter_async_context(serve(app_of(fail)))
        if between == "429":
            b = await stack.enter_async_context(serve(app_of(busy)))
        else:
            b = f"http://127.0.0.1:{refused_port}"
        nodes = [{"name": "a", "url": a}, {"name": "c", "url": c}, {"name": "b", "url": b}]
        config = {
            "nodes": nodes,
            "strategy": "round_robin",
            "health": {"enabled": False},
            "retry": {"attempts": 3},
        }
        app = PromptLBMiddleware(noop, config=config)
        strategy: Any = app.balancer.strategy
        # Round robin from the first node, over the ones not tried yet: a, then b, then c.
        strategy._next = {"m": 0}  # its turn per model
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            got = await http.post("/v1/chat/completions", json={"model": "m", "prompt": "x"})
        table = app.balancer.table.nodes
        assert got.status_code == 500 and got.headers["x-promptlb-node"] == "c"
        assert got.headers["x-promptlb-attempts"] == "3"
        assert [table[n].failures for n in "abc"] == [1, 1, 1]
        assert [table[n].request_faults for n in "abc"] == [0, 0, 0]
        await app.dispatcher.stop()
