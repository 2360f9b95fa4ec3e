"""Host CPU and memory utilisation, from psutil."""

from __future__ import annotations

import psutil

__all__ = ["HostCollector", "HostSample"]

HostSample = tuple[float, float]  # (cpu, mem), each 0..1


class HostCollector:
    def __init__(self) -> None:
        # The first non-blocking cpu_percent() has nothing to compare with and returns 0.0:
        # prime it now so that the first real sample measures the first interval.
        psutil.cpu_percent(interval=None)

    def sample(self) -> HostSample:
        cpu = psutil.cpu_percent(interval=None) / 100.0
        mem = psutil.virtual_memory().percent / 100.0
        return (min(1.0, max(0.0, cpu)), min(1.0, max(0.0, mem)))
