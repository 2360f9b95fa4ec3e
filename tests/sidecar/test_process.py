from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil
import pytest
from promptlb.sidecar._process import ProcessCollector, find_listener


def test_the_listener_of_a_port_is_found() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert find_listener(server.getsockname()[1]) == os.getpid()


def test_a_port_nobody_listens_on_gives_no_rss() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    collector = ProcessCollector(pid=None, port=port)
    assert collector.sample() == (None, None)
    assert f"port {port}" in collector.reason


def test_a_growing_process_has_a_positive_slope() -> None:
    # A child that touches 8 MiB more each time it reads a line: real RSS, real growth.
    code = (
        "import sys\nheld=[]\n"
        "for _ in sys.stdin:\n"
        "    b=bytearray(8<<20); b[::4096]=b'1'*len(range(0,len(b),4096)); held.append(b)\n"
        "    print('ok', flush=True)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        collector = ProcessCollector(pid=child.pid, port=None, window_s=60)
        rss, slope = collector.sample(now=0.0)
        assert rss is not None and rss > 0 and slope is None  # one point is not a trend
        for step in range(1, 5):
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline() == "ok\n"
            rss, slope = collector.sample(now=float(step))
        assert slope is not None
        assert slope == pytest.approx(8 * 2**20, rel=0.25)  # 8 MiB per (virtual) second
    finally:
        child.kill()
        child.wait(timeout=5)


def test_the_window_forgets_old_samples_and_a_new_process_starts_over() -> None:
    collector = ProcessCollector(pid=os.getpid(), port=None, window_s=5)
    for t in range(0, 20, 2):
        collector.sample(now=float(t))
    assert len(collector._history) == 3  # 14, 16, 18: the others are older than 5 s
    gone = psutil.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = ProcessCollector(pid=gone.pid, port=None)
    assert dead.sample() == (None, None)
    assert str(gone.pid) in dead.reason
