"""The degradation bench's own arithmetic (its runs start a gateway and nodes: `make bench`)."""

from __future__ import annotations

from promptlb.bench.degrade_bench import _less, stats


def test_no_answer_of_a_kind_is_no_figure_not_zero_ms() -> None:
    """A phase where nothing was answered 200 read p50 0 ms, as if the 50 ms goal were met, and
    made the differences below negative."""
    row = stats([{"status": 504, "how": "", "s": 0.2}])
    assert row["answered"] == 0 and row["p50_ms"] is None and row["p99_ms"] is None
    assert _less(row["p99_ms"], 12.5) is None and _less(20.0, 12.5) == 7.5
    ok = stats([{"status": 200, "how": "fallback", "s": 0.012}])
    assert ok["p50_ms"] == 12.0 and ok["by_path"]["fallback"] == 1
