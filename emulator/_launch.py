"""Starting promptlb's own executables as real processes, for tests, the demo and benchmarks."""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["Service", "free_port", "start_command", "start_redis", "start_service"]

_LISTENING = re.compile(r"listening on (http://[\w.\[\]:-]+:(\d+))")


@dataclass(eq=False)  # by identity: kept in a set until stopped
class Service:
    """A running promptlb executable: its process, its base URL and its port."""

    name: str
    proc: subprocess.Popen[str]
    url: str
    port: int
    log_path: str
    started_at: float  # time.monotonic() just before the process was spawned

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        """SIGKILL, as a crash would end it, and reaped; `stop` still removes its log."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; safe to call twice or after the process died."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)
        _LIVE.discard(self)


# Every service started and not stopped yet, stopped at the interpreter's exit: a script that
# ends on an exception before its own stop() left its emulators and gateways running. Held
# strongly: in a weak set, a service whose caller kept only its URL was collected and its
# process left running.
_LIVE: set[Service] = set()


@atexit.register
def _stop_all() -> None:
    for service in list(_LIVE):
        with contextlib.suppress(Exception):
            service.stop()


def start_service(module: str, *args: str, timeout: float = 20.0) -> Service:
    """Run ``python -m promptlb.<module> --port 0 ARGS`` and wait for its listening line."""
    return start_command(module, ["-m", f"promptlb.{module}", "--port", "0", *args], timeout)


def start_command(name: str, argv: list[str], timeout: float = 20.0) -> Service:
    """Run ``python ARGV`` (which must print a ``listening on`` line) and wait for that line.

    Port 0 lets the process pick a free port, so there is no race over a port chosen in advance.
    stderr (the logs) goes to a file, readable with `Service.log`.
    """
    started_at = time.monotonic()
    with tempfile.NamedTemporaryFile(
        prefix=f"promptlb-{name}-", suffix=".log", delete=False
    ) as log:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # keep reading, so that the child never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"{name} did not listen within {timeout:g}s:\n{_read(log.name)}"
                ) from None
            if line is None:
                raise RuntimeError(f"{name} exited before listening:\n{_read(log.name)}")
            if match := _LISTENING.search(line):
                service = Service(
                    name, proc, match.group(1), int(match.group(2)), log.name, started_at
                )
                _LIVE.add(service)
                return service
    except BaseException:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # not in place of the real error
            proc.wait(timeout=5)
        if proc.stdout is not None and proc.poll() is not None:
            # (A child still alive keeps the pump's read, and closing under it would block.)
            proc.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)
        raise


def start_redis(
    binary: str, workdir: str, timeout: float = 5.0, *, port: int | None = None
) -> Service:
    """A throwaway ``redis-server`` (no persistence) on a free loopback port, once it answers
    with its own pid; its `Service.url` is ``redis://127.0.0.1:PORT/0``. Redis has no port 0
    of its own, so the port is one the kernel just handed out, unless ``port`` is given (a
    Redis brought back where its clients were told to find it). A port it chose and another
    process took before Redis bound it is given up for another, twice at most."""
    if port is not None:
        return _start_redis(binary, workdir, timeout, port)
    for attempt in range(3):
        try:
            return _start_redis(binary, workdir, timeout, free_port())
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("not reached")


class _PortTaken(RuntimeError):
    """Redis could not bind the port: another process holds it."""


def free_port() -> int:
    """A free 127.0.0.1 port for a process that cannot take port 0 and tell (Redis, nginx,
    Prometheus). Another process may take it before the bind: starts retry on that."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _start_redis(binary: str, workdir: str, timeout: float, port: int) -> Service:
    started_at = time.monotonic()
    with tempfile.NamedTemporaryFile(prefix="promptlb-redis-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            [
                *(binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""),
                *("--appendonly", "no", "--dir", workdir, "--logfile", log.name),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    service = Service("redis", proc, f"redis://127.0.0.1:{port}/0", port, log.name, started_at)
    deadline = time.monotonic() + timeout
    # Ours must be the one answering: with ``port`` given, another Redis may hold it, and ours
    # dies on "Address already in use" while the stranger answers.
    while _redis_pid(port) != proc.pid:
        if proc.poll() is not None or time.monotonic() > deadline:
            why = _read(log.name)  # before stop() removes the log
            service.stop()
            taken = "address already in use" in why.lower()
            raise (_PortTaken if taken else RuntimeError)(
                f"redis-server did not start on port {port}:\n{why}"
            )
        time.sleep(0.02)
    _LIVE.add(service)
    return service


def _redis_pid(port: int) -> int | None:
    """The pid of the Redis answering on ``port`` (its ``INFO server``), or None."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
            conn.sendall(b"INFO server\r\n")
            reply = b""
            # Read until the pid's line is whole (the reply comes in one or a few chunks).
            while not re.search(rb"process_id:\d+\r\n", reply) and len(reply) < 65536:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return None
    match = re.search(rb"process_id:(\d+)", reply)
    return int(match.group(1)) if match else None


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
