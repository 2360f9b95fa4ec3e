"""The launcher: its Redis started on a free port (or the one asked for), answering, and gone
once stopped or killed; every service it started stopped when the script exits."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from promptlb.emulator import _launch, start_redis

from tests.conftest import need_binary


def test_a_throwaway_redis_answers_and_stop_leaves_nothing(tmp_path: Path) -> None:
    service = start_redis(need_binary("redis-server", "redis-server"), str(tmp_path))
    try:
        client = redis.Redis.from_url(service.url)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        client.close()
    finally:
        service.stop()
    assert service.proc.poll() is not None
    assert not os.path.exists(service.log_path)
    assert not list(tmp_path.iterdir())  # no dump: nothing persisted


def test_a_redis_killed_comes_back_on_the_port_its_clients_know(tmp_path: Path) -> None:
    binary = need_binary("redis-server", "redis-server")
    first = start_redis(binary, str(tmp_path))
    first.kill()
    assert first.proc.returncode == -9  # SIGKILL, as a crash
    first.stop()  # its log
    again = start_redis(binary, str(tmp_path), port=first.port)
    try:
        assert again.port == first.port and again.url == first.url
        client = redis.Redis.from_url(again.url)
        assert client.ping()
        client.close()
    finally:
        again.stop()
    assert not os.path.exists(first.log_path) and not os.path.exists(again.log_path)


def test_a_port_another_redis_holds_is_refused_with_ours_saying_why(tmp_path: Path) -> None:
    # The stranger answered PING while ours died on "Address already in use": the caller got
    # a Redis it did not start, which its stop() never touched.
    binary = need_binary("redis-server", "redis-server")
    stranger = start_redis(binary, str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="did not start") as failed:
            start_redis(binary, str(tmp_path), port=stranger.port)
        assert "in use" in str(failed.value).lower() or "bind" in str(failed.value).lower()
    finally:
        stranger.stop()


def test_a_port_taken_before_redis_binds_it_is_given_up_for_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The port is chosen, let go, then bound by Redis: another process taking it between was
    # a "did not start" for the whole fixture.
    binary = need_binary("redis-server", "redis-server")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = [taken]
        real = _launch.free_port
        monkeypatch.setattr(_launch, "free_port", lambda: ports.pop() if ports else real())
        service = start_redis(binary, str(tmp_path))
        try:
            assert service.port != taken and not ports
            client = redis.Redis.from_url(service.url)
            assert client.ping()
            client.close()
        finally:
            service.stop()


def test_a_service_whose_caller_kept_only_its_url_is_stopped_at_exit() -> None:
    # The script keeps the URL, not the Service: held weakly, it was collected and its
    # emulator left running after the script had ended.
    script = (
        "import gc\n"
        "from promptlb.emulator import start_service\n"
        "service = start_service('emulator')\n"
        "url, pid = service.url, service.pid\n"
        "del service\n"
        "gc.collect()\n"
        "print(url, pid, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    url, pid = done.stdout.split()
    with socket.socket() as probe:
        outlived = probe.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) == 0
    if outlived:  # this test's leftover, still listening (so its pid is still its own)
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    assert not outlived, "the emulator outlived the script"
