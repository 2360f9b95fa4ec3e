from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from promptlb.sidecar import _process
from promptlb.sidecar._process import (
    HIDDEN,
    LOOKUP_BACKOFF_S,
    ProcessCollector,
    find_listener,
    is_local_host,
    memory_free,
)


def test_the_listener_of_a_port_is_found() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert find_listener(server.getsockname()[1]) == os.getpid()


def test_a_port_nobody_listens_on_gives_no_rss(refused_port: int) -> None:
    port = refused_port
    collector = ProcessCollector(pid=None, port=port)
    assert collector.sample() == (None, None)
    assert f"port {port}" in collector.reason


def test_a_lookup_by_port_that_finds_nobody_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each lookup walks every process's sockets: a server out of sight (another PID namespace)
    # or still loading must not cost a walk of the host four times a second.
    lookups: list[int] = []

    def counted(port: int) -> int | None:
        lookups.append(port)
        return None

    monkeypatch.setattr(_process, "find_listener", counted)
    now = [100.0]
    collector = ProcessCollector(pid=None, port=8000, clock=lambda: now[0])
    for _ in range(5):
        assert collector.sample() == (None, None)
    assert lookups == [8000] and "port 8000" in collector.reason
    now[0] += LOOKUP_BACKOFF_S
    collector.sample()
    assert lookups == [8000, 8000]


def test_a_listener_whose_pid_is_hidden_is_said_to_listen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's server: psutil lists its socket without a pid, which read as "no process
    listens on port 8000" while it served."""
    hidden = SimpleNamespace(status=psutil.CONN_LISTEN, laddr=SimpleNamespace(port=8000), pid=None)
    monkeypatch.setattr(psutil, "net_connections", lambda kind: [hidden])
    assert find_listener(8000) == HIDDEN and find_listener(8001) is None
    collector = ProcessCollector(pid=None, port=8000)
    assert collector.sample() == (None, None)
    assert "listens on port 8000, but this user cannot see its pid" in collector.reason


def test_only_a_model_url_on_this_host_is_looked_up_by_port() -> None:
    assert is_local_host("127.0.0.1") and is_local_host("localhost") and is_local_host("::1")
    assert is_local_host("127.0.0.53")
    # A bind address copied into the URL, and the IPv4 loopback written as IPv6.
    assert is_local_host("0.0.0.0") and is_local_host("::") and is_local_host("[::]")
    assert is_local_host("::ffff:127.0.0.1")
    ours = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    assert all(is_local_host(address) for address in ours)
    assert not is_local_host("192.0.2.7")  # TEST-NET-1: never an interface's here
    assert not is_local_host("models.example.com") and not is_local_host(None)


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


def test_against_a_limit_a_forked_servers_shared_pages_count_once() -> None:
    # 64 MiB touched, then a fork: both processes map the same pages. The RSS sum counts them
    # twice, which under --memory-limit-mb read as no memory free, and a "leak" drain.
    code = (
        "import os, sys, time\n"
        "b=bytearray(64<<20); b[::4096]=b'1'*len(range(0,len(b),4096))\n"
        "if os.fork() == 0:\n    time.sleep(60); os._exit(0)\n"
        "print('ok', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    try:
        assert child.stdout.readline() == "ok\n"
        plain = ProcessCollector(pid=child.pid, port=None)
        proportional = ProcessCollector(pid=child.pid, port=None, proportional=True)
        rss, _ = proportional.sample(now=0.0)
        assert rss is not None and rss > 128 << 20  # both processes' 64 MiB
        assert proportional.pss is not None and proportional.pss < 0.7 * rss
        assert plain.sample(now=0.0)[0] is not None and plain.pss is None
        limit = 160 << 20
        free = memory_free(proportional.pss, limit)
        assert free is not None and free > 32 << 20  # the RSS sum: nearly none
        for process in psutil.Process(child.pid).children(recursive=True):
            process.kill()
        child.kill()
        child.wait(timeout=5)
        # Gone: nothing held against the limit, not the dead tree's last reading.
        assert proportional.sample(now=0.5) == (None, None) and proportional.pss is None
    finally:
        if child.poll() is None:  # (reaped, its pid may be another process's by now)
            with contextlib.suppress(psutil.Error):
                for process in psutil.Process(child.pid).children(recursive=True):
                    process.kill()
        child.kill()
        child.wait(timeout=5)


def test_a_process_gone_between_the_check_and_the_read_is_a_restart_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collector = ProcessCollector(pid=os.getpid(), port=None)
    assert collector.sample()[0] is not None and not collector.restarted

    def gone(proc: psutil.Process) -> int:
        raise psutil.NoSuchProcess(proc.pid)

    monkeypatch.setattr(collector, "_tree_rss", gone)
    assert collector.sample() == (None, None) and collector.restarted
    monkeypatch.undo()
    collector.sample()  # found again (the same pid here): no second restart
    assert not collector.restarted


def test_a_long_window_fits_a_bounded_number_of_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    # A day's window at 4 samples a second held 345,600 and refitted them all each time.
    collector = ProcessCollector(pid=os.getpid(), port=None, window_s=86_400)
    clock = {"now": 0.0}
    monkeypatch.setattr(collector, "_tree_rss", lambda proc: int(1e9 + 1_000 * clock["now"]))
    slope = None
    for step in range(40_000):  # 10,000 s at 250 ms
        clock["now"] = step * 0.25
        rss, slope = collector.sample(now=clock["now"])
        assert rss == int(1e9 + 1_000 * clock["now"])  # the reading itself is every sample's
    assert len(collector._history) <= 1_025
    assert slope == pytest.approx(1_000, rel=1e-6)


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


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return  # reaped: its pid may be another process's by now (Popen's own kill knows)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    proc.kill()
    proc.wait(timeout=5)


def test_the_rss_of_child_processes_is_counted() -> None:
    # vLLM V1 and SGLang: the listening process is small, the engine child holds the memory.
    child = (
        "import sys\nb=bytearray(64<<20); b[::4096]=b'1'*len(range(0,len(b),4096))\n"
        "print('ok', flush=True)\nsys.stdin.read()\n"
    )
    parent_code = (
        f"import subprocess,sys\nsubprocess.Popen([sys.executable, '-c', {child!r}]).wait()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    try:
        assert parent.stdout.readline() == "ok\n"  # the grandchild holds its 64 MiB
        alone = psutil.Process(parent.pid).memory_info().rss
        rss, _ = ProcessCollector(pid=parent.pid, port=None).sample()
        assert rss is not None and rss >= alone + 64 * 2**20
    finally:
        _kill_tree(parent)


def _listener(port: int = 0) -> tuple[subprocess.Popen[str], int]:
    code = (
        "import socket,sys\ns=socket.socket()\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
        "print(s.getsockname()[1], flush=True)\nsys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_a_process_replaced_on_the_port_is_flagged_once_as_restarted() -> None:
    first, port = _listener()
    collector = ProcessCollector(pid=None, port=port)
    second = None
    try:
        assert collector.sample()[0] is not None
        assert not collector.restarted  # the first process found is no restart
        assert collector.sample()[0] is not None and not collector.restarted
        first.kill()
        first.wait(timeout=5)
        second, same_port = _listener(port)  # quicker than any probe would notice
        assert same_port == port
        rss, slope = collector.sample()
        assert rss is not None and slope is None and collector.restarted
        collector.sample()
        assert not collector.restarted  # only the sample that found the new process says so
    finally:
        _kill_tree(first)
        if second is not None:
            _kill_tree(second)


def test_a_restart_is_said_when_the_process_goes_not_again_when_its_successor_is_found() -> None:
    # The lookup by port backs off while nobody listens; the probe sees the new server first
    # and warms it. Said on finding the successor, the restart took the warm node out again.
    first, port = _listener()
    clock = {"now": 0.0}
    collector = ProcessCollector(pid=None, port=port, clock=lambda: clock["now"])
    second = None
    try:
        assert collector.sample()[0] is not None and not collector.restarted
        first.kill()
        first.wait(timeout=5)
        assert collector.sample() == (None, None) and collector.restarted  # seen gone
        assert collector.sample() == (None, None) and not collector.restarted
        second, _ = _listener(port)
        clock["now"] += LOOKUP_BACKOFF_S  # the lookup's next turn
        assert collector.sample()[0] is not None and not collector.restarted
    finally:
        _kill_tree(first)
        if second is not None:
            _kill_tree(second)


def test_the_memory_left_is_under_the_configured_limit_else_the_hosts() -> None:
    assert memory_free(300, limit=1000) == 700
    assert memory_free(2000, limit=1000) == 0
    assert memory_free(None, limit=1000) is None  # no reading of the process: no projection
    free = memory_free(100)
    assert free is not None and 0 < free <= psutil.virtual_memory().total


def test_a_cgroup_limit_counts_the_working_set_not_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights read from disk fill a cgroup's page cache up to its limit: that is no threat."""
    from promptlb.sidecar import _process

    group = tmp_path / "cg" / "pod" / "model"
    group.mkdir(parents=True)
    (tmp_path / "cg" / "pod" / "memory.max").write_text("1000\n")  # the pod's, tighter
    (group / "memory.max").write_text("max\n")
    (group / "memory.current").write_text("950\n")
    (group / "memory.stat").write_text("anon 300\ninactive_file 600\nactive_file 50\n")
    proc = tmp_path / "proc" / "42"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/pod/model\n")
    monkeypatch.setattr(_process, "_CGROUP", tmp_path / "cg")
    real = Path

    def fake(p: str | Path = ".") -> Path:
        text = str(p)
        return real(str(tmp_path) + text) if text.startswith("/proc/") else real(p)

    monkeypatch.setattr(_process, "Path", fake)
    assert memory_free(300, pid=42) == 1000 - (950 - 600)


def test_a_model_server_that_exited_unreaped_is_gone_not_alive_and_empty() -> None:
    """psutil calls a zombie running and reads its memory as 0: a server that died under a
    parent that did not reap it read as alive with nothing in memory, its restart unseen."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        collector = ProcessCollector(pid=child.pid, port=None)
        assert collector.sample()[0] and not collector.restarted
        child.kill()
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # not reaped yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert collector.sample() == (None, None) and collector.restarted
    finally:
        child.kill()
        child.wait(timeout=5)


def test_a_pss_this_user_may_not_read_is_asked_again_only_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user's smaps: refused, it was asked again at every sample, 4 a second."""
    asked: list[int] = []

    def refused(proc: psutil.Process) -> None:
        asked.append(proc.pid)

    collector = ProcessCollector(pid=os.getpid(), port=None, proportional=True)
    monkeypatch.setattr(collector, "_tree_pss", refused)
    with caplog.at_level(logging.INFO, "promptlb.sidecar.process"):
        for step in range(40):  # 10 s at 250 ms
            collector.sample(now=step * 0.25)
    assert len(asked) == 5 and collector.pss is None  # at 0, 2, 4, 6 and 8 s
    assert sum("not readable" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    ("window", "interval"), [(1.0, 0.26), (1.2, 0.603), (1.0, 0.5), (1.2, 0.59)]
)
def test_a_short_window_the_config_allows_gives_a_slope(
    monkeypatch: pytest.MonkeyPatch, window: float, interval: float
) -> None:
    """A slope needed a second of samples, which a window of 1 s (or 1.2 s at 0.6 s) never
    holds: leaks went unseen with settings the config took."""
    collector = ProcessCollector(pid=os.getpid(), port=None, window_s=window)
    clock = {"now": 0.0}
    monkeypatch.setattr(collector, "_tree_rss", lambda proc: int(1e9 + 1_000 * clock["now"]))
    slope = None
    jitter = [0.0, 0.012, 0.003, 0.018, 0.007]  # the loop's lateness, a few ms a sample
    for step in range(20):
        clock["now"] = step * interval + jitter[step % len(jitter)]
        _, slope = collector.sample(now=clock["now"])
        if step >= 4:  # every sample once the window has filled
            assert slope == pytest.approx(1_000, rel=1e-6), step
