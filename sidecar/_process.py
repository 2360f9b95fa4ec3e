"""The model server's resident memory and its trend: the early warning of a leak."""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import psutil

__all__ = [
    "HIDDEN",
    "ProcessCollector",
    "find_listener",
    "is_local_host",
    "is_loopback",
    "memory_free",
]

# Samples a slope is fitted over, at most, spread over the window: a day's window sampled every
# 250 ms held 345,600 and fitted them all on every sample (0.15 s of the GIL, 40 MB).
_POINTS = 1024
LOOKUP_BACKOFF_S = 5.0  # after a lookup by port found nobody: it walks every process's fds
log = logging.getLogger("promptlb.sidecar.process")
# Proportional set size reads every mapping's page counts (/proc/<pid>/smaps_rollup): a few ms
# for a big engine process, so at most this often.
PSS_EVERY_S = 2.0


def is_loopback(address: str | None) -> bool:
    """Whether a peer's address is this host's loopback (IPv4, IPv6, or IPv4 as IPv6)."""
    try:
        return _unmapped(ipaddress.ip_address(address or "")).is_loopback
    except ValueError:
        return False


def _unmapped(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``::ffff:127.0.0.1`` as ``127.0.0.1``: one host, whichever way a socket spells it."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_local_host(host: str | None) -> bool:
    """Whether the model URL's host is this one (loopback, or an address of this host's
    interfaces): only then is the process listening on its port the model server. Any
    local process on port 8000 was adopted for a remote server, its restarts making the
    node cold."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        address = _unmapped(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return False  # a name: not resolved here, and not assumed ours
    # 0.0.0.0 and :: (a server's bind address, often copied into its URL) reach this host.
    if address.is_loopback or address.is_unspecified:
        return True
    try:
        ours = {
            a.address.split("%", 1)[0] for addrs in psutil.net_if_addrs().values() for a in addrs
        }
    except OSError:
        return False
    return str(address) in ours


HIDDEN = -1  # `find_listener`: something listens, but this user cannot see its pid


def find_listener(port: int) -> int | None:
    """The pid of the process listening on a TCP port of this host; `HIDDEN` when one
    listens whose pid this user may not see (another user's process); None for none."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return int(conn.pid) if conn.pid is not None else HIDDEN
    return None


_CGROUP = Path("/sys/fs/cgroup")


def memory_free(held: int | None, limit: int | None = None, pid: int | None = None) -> int | None:
    """Bytes the model server may still take before it is killed for memory: under a configured
    ``limit``, that less what it ``held`` (its tree's PSS where readable, else RSS); else under
    the tightest cgroup v2 ``memory.max`` on its process's cgroup path (when this sidecar can
    see it), less that cgroup's working set (its use less the page cache the kernel reclaims
    first: weights read from disk fill the cache up to the limit without being a threat); else
    the host's available memory."""
    if limit is not None:
        return None if held is None else max(0, limit - held)
    if pid is not None:
        free = _cgroup_free(pid)
        if free is not None:
            return free
    return int(psutil.virtual_memory().available)


def _cgroup_free(pid: int) -> int | None:
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        path = next(line[3:] for line in lines if line.startswith("0::"))
        leaf = _CGROUP / path.lstrip("/")
        if not (leaf / "memory.current").exists():
            return None  # another container's cgroup, out of this one's sight
        caps = []
        for folder in (leaf, *leaf.parents):
            if folder == _CGROUP.parent:
                break
            cap = folder / "memory.max"
            if cap.exists() and (text := cap.read_text().strip()) != "max":
                caps.append(int(text))
        if not caps:
            return None
        used = int((leaf / "memory.current").read_text())
        stat = dict(
            line.split() for line in (leaf / "memory.stat").read_text().splitlines() if line
        )
        working = used - int(stat.get("inactive_file", 0))
        return max(0, min(caps) - working)
    except (OSError, ValueError, StopIteration):
        return None


class ProcessCollector:
    """RSS of the model server, by pid or by the port it listens on, and its slope in bytes/s.

    The RSS is summed over the process and all its descendants: vLLM V1 and SGLang run their
    engines in child processes, where most of the memory is. Pages shared between them count
    once per process, so the sum overstates; the slope, which is what warns of a leak, does not
    care.

    With ``proportional``, `pss` is the tree's proportional set size besides, every
    `PSS_EVERY_S`: the memory it holds with each shared page counted once, what a limit on the
    whole server is measured against (a 200 MiB server that forked a worker reads 420 MiB RSS
    and 210 MiB PSS).

    The slope is a least-squares fit over the last ``window_s``; it is ``None`` until the window
    holds two samples a second apart, and starts over when the process is replaced (a restart
    is not a leak) or on ``restart_window()``. ``restarted`` is true after a sample that found
    the process gone (or, not having seen that, a different process than the one before it).
    """

    def __init__(
        self,
        *,
        pid: int | None,
        port: int | None,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        proportional: bool = False,
    ) -> None:
        self._pid = pid
        self._proportional = proportional
        self._pss_at = -math.inf
        self._pss_refused = False  # said once
        self.pss: int | None = None
        self._port = port
        self._window_s = window_s
        self._clock = clock
        self._next_lookup = 0.0  # by port: after a miss, not before this
        self._proc: psutil.Process | None = None
        self._previous: psutil.Process | None = None  # the last process found, even if gone
        self._history: collections.deque[tuple[float, int]] = collections.deque()
        self._last_slope: float | None = None
        self.reason = ""
        self.restarted = False

    def _process(self) -> psutil.Process | None:
        if self._proc is not None:
            if self._proc.is_running() and not _zombie(self._proc):
                return self._proc
            # Said when the process is seen gone, not when its successor is found: the probe
            # may see the new server first (the lookup by port backs off), warm it, and a
            # restart told then took the node out again for a second warmup.
            self.restarted = True
            self._previous = None
        self._proc = None
        self._history.clear()
        self.pss = None  # another process's, or none: read afresh
        self._pss_at = -math.inf
        pid = self._pid
        if pid is None and self._port:
            now = self._clock()
            if now < self._next_lookup:
                return None  # the reason of the last miss stands
            pid = find_listener(self._port)
            if pid == HIDDEN:
                # "No process listens" sent the operator looking for a server that was up.
                self._next_lookup = now + LOOKUP_BACKOFF_S
                self.reason = (
                    f"a process listens on port {self._port}, but this user cannot see its"
                    " pid (run the sidecar as the model server's user, or pass --model-pid)"
                )
                return None
            if pid is None:
                # A server still loading, or one out of this sidecar's sight (another PID
                # namespace): not a walk of the host's every socket four times a second.
                self._next_lookup = now + LOOKUP_BACKOFF_S
        if pid is None:
            self.reason = (
                f"no process listens on port {self._port}"
                if self._port
                else "no model-server pid (not on this host: --model-pid names it)"
            )
            return None
        try:
            found = psutil.Process(pid)
        except psutil.Error as exc:
            self.reason = f"model-server process {pid}: {exc}"
            return None
        if _zombie(found):
            self.reason = f"model-server process {pid} exited (not yet reaped by its parent)"
            return None
        self._proc = found
        # psutil compares pid and creation time: a reused pid is a different process too.
        if self._previous is not None and self._proc != self._previous:
            self.restarted = True  # replaced while not looked at (a lookup that failed)
        self._previous = self._proc
        self.reason = ""
        return self._proc

    @staticmethod
    def _children(proc: psutil.Process) -> list[psutil.Process]:
        try:
            return proc.children(recursive=True)
        except psutil.Error:
            return []

    @staticmethod
    def _tree_rss(proc: psutil.Process) -> int:
        rss = int(proc.memory_info().rss)
        for child in ProcessCollector._children(proc):
            # A child may exit between the listing and the reading, or not be ours to read.
            with contextlib.suppress(psutil.Error):
                rss += int(child.memory_info().rss)
        return rss

    @staticmethod
    def _tree_pss(proc: psutil.Process) -> int | None:
        try:
            total = int(proc.memory_full_info().pss)
        except psutil.Error:  # AccessDenied: smaps is the owner's (or root's) to read
            return None
        for child in ProcessCollector._children(proc):
            try:
                total += int(child.memory_full_info().pss)
            except psutil.AccessDenied:
                with contextlib.suppress(psutil.Error):
                    total += int(child.memory_info().rss)
            except psutil.Error:
                pass  # exited since the listing
        return total

    @property
    def pid(self) -> int | None:
        """The model server's pid as last found; None while none is."""
        return self._proc.pid if self._proc is not None else None

    def restart_window(self) -> None:
        """Forget the samples so far: the next slope counts only what comes after (a model
        loading its weights grows by gigabytes, and that is no leak)."""
        self._history.clear()

    def sample(self, now: float | None = None) -> tuple[int | None, float | None]:
        self.restarted = False
        proc = self._process()
        if proc is None:  # (`_process` let the last one's PSS go)
            return (None, None)
        try:
            rss = self._tree_rss(proc)
        except psutil.Error as exc:
            self.reason = f"model-server process {proc.pid}: {exc}"
            self._proc = None
            self.pss = None  # not the gone process's, for a memory limit to be held against
            self._pss_at = -math.inf
            if isinstance(exc, psutil.NoSuchProcess):  # gone between the check and the read
                self.restarted = True
                self._previous = None
            return (None, None)
        now = time.monotonic() if now is None else now
        # A new process's at once, then every PSS_EVERY_S: one this sidecar may not read
        # (another user's smaps) was asked again at every sample, 4 a second, for good.
        if self._proportional and now - self._pss_at >= PSS_EVERY_S:
            self.pss = self._tree_pss(proc)
            self._pss_at = now
            if self.pss is None and not self._pss_refused and proc.is_running():
                self._pss_refused = True
                log.info(
                    "model-server process %d: its PSS is not readable by this user; the memory"
                    " limit is held against its tree's RSS, which counts shared pages twice",
                    proc.pid,
                )
        history = self._history
        if history and now - history[-1][0] < self._window_s / _POINTS:
            return (rss, self._last_slope)  # the fit holds at most `_POINTS` samples
        history.append((now, rss))
        while history and now - history[0][0] > self._window_s:
            history.popleft()
        self._last_slope = self._slope()
        return (rss, self._last_slope)

    def _slope(self) -> float | None:
        history = self._history
        # A span of a second at least (less is noise), or about half the window where that is
        # shorter: a window of 1 s never held a second of samples, and gave no slope ever (and
        # at a window of twice the interval the span is one interval, give or take the loop's
        # jitter: the slack keeps it from dropping out every other sample).
        if len(history) < 2 or history[-1][0] - history[0][0] < min(1.0, 0.4 * self._window_s):
            return None
        n = len(history)
        mean_t = sum(t for t, _ in history) / n
        mean_r = sum(r for _, r in history) / n
        var = sum((t - mean_t) ** 2 for t, _ in history)
        cov = sum((t - mean_t) * (r - mean_r) for t, r in history)
        return cov / var if var > 0 else None


def _zombie(proc: psutil.Process) -> bool:
    """Whether ``proc`` exited and waits for its parent to reap it: psutil calls it running,
    and its memory reads 0 without an error, so a model server that died under a parent
    that did not reap it read as alive and empty (no restart seen, the whole limit free)."""
    try:
        return bool(proc.status() == psutil.STATUS_ZOMBIE)
    except psutil.Error:  # gone meanwhile: is_running() says so on the next look
        return False
