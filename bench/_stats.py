"""The benchmarks' statistics, one convention for all of them (live runs and the simulator):

* percentiles are given in 0..100 (``p99`` is ``percentile(values, 99)``), as every report names
  them, interpolated linearly between closest ranks (numpy's default "linear" method);
* the input need not be sorted: it is sorted here, which costs O(n) on an already sorted list
  (timsort finds the one run), so a caller asking for several percentiles may sort once first;
* no values give ``None``, not NaN: the reports are JSON, where ``null`` is valid and NaN is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["jain", "percentile"]


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) of ``values``; None for no values."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is not in 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one node
    takes everything. None without values; 1 when all are zero (equally idle is fair)."""
    if not values:
        return None
    square_sum = sum(v * v for v in values)
    if square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)
