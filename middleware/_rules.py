"""The middleware's routing rules as pure functions of numbers: no I/O, no clock, no config.

`Balancer` and `NodeTable` apply them on real time; the benchmark's simulator applies the same
ones on virtual time, so that what it measures is the middleware's behaviour and not a copy of it.
"""

from __future__ import annotations

import math

__all__ = ["MIN_RAMP", "RetryBudget", "ejection_cap", "ejection_time", "ramp"]

# A node back from an outage starts at a tenth of its share: enough traffic to show whether it
# really recovered, too little to drown it if it did not.
MIN_RAMP = 0.1


class RetryBudget:
    """Retries in flight may not exceed a share of active requests (Envoy's retry budget)."""

    __slots__ = ("active", "min_concurrent", "percent", "retrying")

    def __init__(self, percent: float, min_concurrent: int) -> None:
        self.percent = percent / 100.0
        self.min_concurrent = min_concurrent
        self.active = 0
        self.retrying = 0

    def allow(self) -> bool:
        return self.retrying < max(self.min_concurrent, self.percent * self.active)


def ramp(ready_for: float, slow_start: float) -> float:
    """The share of its traffic a node takes ``ready_for`` seconds after it became a candidate
    again: linear over ``slow_start`` seconds from `MIN_RAMP`, then whole (0 disables it)."""
    if slow_start <= 0:
        return 1.0
    return max(MIN_RAMP, min(1.0, ready_for / slow_start))


def ejection_time(times_ejected: int, base: float, most: float) -> float:
    """Seconds an outlier stays out on its ``times_ejected``-th ejection: longer each time a
    node keeps failing, up to ``most`` (Envoy's outlier detection)."""
    return min(base * times_ejected, most)


def ejection_cap(pool: int, percent: float) -> int:
    """How many of ``pool`` nodes may be ejected at once: ``percent`` of them, but always one,
    or a small pool could never eject its bad node (Envoy's rule)."""
    return max(1, math.floor(pool * percent / 100))
