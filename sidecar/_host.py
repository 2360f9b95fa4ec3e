"""Host CPU and memory utilisation, from psutil."""

from __future__ import annotations

from typing import Any

import psutil

__all__ = ["HostCollector", "HostSample"]

HostSample = tuple[float, float]  # (cpu, mem), each 0..1


def _busy_and_total(times: Any) -> tuple[float, float]:
    """CPU seconds busy and in all, as psutil's cpu_percent counts them: idle and iowait are
    not busy; on Linux guest time is already in user time, so it is not counted twice."""
    total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    return total - times.idle - getattr(times, "iowait", 0.0), total


class HostCollector:
    """Each sample measures the CPU since the previous one, whichever thread takes it.

    Not psutil's ``cpu_percent(interval=None)``: it keeps its previous reading per calling
    thread, and the samples run on the event loop's worker threads, any of them. A worker's
    first call returned 0.0, and a later one measured from that worker's own last call, which
    may have been many intervals before."""

    def __init__(self) -> None:
        self._last = _busy_and_total(psutil.cpu_times())

    def sample(self) -> HostSample:
        busy, total = _busy_and_total(psutil.cpu_times())
        last_busy, last_total = self._last
        self._last = (busy, total)
        elapsed = total - last_total
        cpu = (busy - last_busy) / elapsed if elapsed > 0 else 0.0
        mem = psutil.virtual_memory().percent / 100.0
        return (min(1.0, max(0.0, cpu)), min(1.0, max(0.0, mem)))
