"""The middleware's routing rules as pure functions of numbers: no I/O, no clock, no config.

`Balancer` and `NodeTable` apply them on real time; the benchmark's simulator applies the same
ones on virtual time, so that what it measures is the middleware's behaviour and not a copy of it.
"""

from __future__ import annotations

import math

__all__ = [
    "ERROR_FLOOR",
    "ERROR_HALF_LIFE",
    "ERROR_WEIGHT",
    "MIN_RAMP",
    "RetryBudget",
    "after_try",
    "eases",
    "ejection_cap",
    "ejection_time",
    "faded",
    "ramp",
]

# A node back from an outage starts at a tenth of its share: enough traffic to show whether it
# really recovered, too little to drown it if it did not.
MIN_RAMP = 0.1

# A node's error rate is an EWMA of its tries' failures (this weight on the newest) that also
# fades with time, halving every ERROR_HALF_LIFE seconds, and reads 0 below ERROR_FLOOR. Over
# answers alone it never fell for a node sent nothing: the predictive strategy sends a node that
# failed a few tries nothing while others serve (after a ten-second hang in the fault suite, none
# while watched, its rate stuck at 0.59), and a node sent nothing cannot show a leak or a
# recovery. Faded, it is tried again within half a minute; if it still fails, that costs a retry
# (Finagle's peak EWMA latency decays with time for the same reason).
ERROR_WEIGHT = 0.2
ERROR_HALF_LIFE = 5.0
ERROR_FLOOR = 0.01


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


def eases(times_ejected: int, back: float | None, eased_at: float, now: float, base: float) -> bool:
    """Whether a node ejected before, back since ``back`` (None: not back), has now stayed
    back a ``base`` ejection time since then or since its count last eased (``eased_at``):
    its next ejection is then a step shorter (Envoy's; the count only grew, and bursts days
    apart ended in the longest)."""
    return times_ejected > 0 and back is not None and now - max(back, eased_at) >= base


def ejection_cap(pool: int, percent: float) -> int:
    """How many of ``pool`` nodes may be ejected at once: ``percent`` of them, but always one,
    or a small pool could never eject its bad node (Envoy's rule)."""
    return max(1, math.floor(pool * percent / 100))


def faded(rate: float, elapsed: float) -> float:
    """An error rate ``elapsed`` seconds on. Below the floor it reads as none at all: the
    predictive strategy weighs any rate above 0, and a node kept a hair behind equal ones would
    still lose every pick between the best two."""
    if not rate or elapsed <= 0.0:
        return rate
    rate *= 0.5 ** (elapsed / ERROR_HALF_LIFE)
    return rate if rate >= ERROR_FLOOR else 0.0


def after_try(rate: float, ok: bool) -> float:
    """The error rate once a try has ended (``rate`` faded to now first)."""
    return rate + ERROR_WEIGHT * ((0.0 if ok else 1.0) - rate)
