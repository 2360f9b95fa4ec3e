"""A simulated model server's memory (`_simleak`), and the gateway's leak drain the simulated
replicas apply to it by the middleware's rule."""

from __future__ import annotations

from typing import Any

import pytest
from promptlb.bench._scenario import (
    RSS_WINDOW_S,
    Dist,
    Fault,
    NodeSpec,
    PromptClass,
    Scenario,
    Workload,
)
from promptlb.bench._simcore import SimParams, simulate
from promptlb.bench._simleak import IDLE_RSS_MB, Memory

MiB = 2**20


def test_a_leak_grows_the_rss_per_request_and_its_slope_over_the_window() -> None:
    memory = Memory(300)
    assert not memory.request(0.0)  # no leak fault: nothing moves
    assert memory.reading(0.0) == (round(IDLE_RSS_MB * MiB), 0.0, round((300 - IDLE_RSS_MB) * MiB))
    memory.per_request_mb = 4.0
    for i in range(4):  # 4 a second: 16 MB/s
        assert memory.request(10.0 + i / 4)
    _, early, _ = memory.reading(11.0)  # a second in: growing into the rate, as a fit does
    assert early == pytest.approx(16 / RSS_WINDOW_S * MiB)
    for i in range(4, 20):
        assert memory.request(10.0 + i / 4)
    rss, slope, free = memory.reading(10.0 + RSS_WINDOW_S)
    assert rss == round((IDLE_RSS_MB + 80) * MiB)
    assert slope == pytest.approx(76 / RSS_WINDOW_S * MiB)  # the window opens after the first
    assert free == round((300 - IDLE_RSS_MB - 80) * MiB)
    _, later, _ = memory.reading(30.0)  # the leak stopped long ago: flat, the RSS kept
    assert later == 0.0 and memory.rss_mb == IDLE_RSS_MB + 80
    boot = memory.boot
    memory.restart()
    assert (memory.rss_mb, memory.per_request_mb, memory.boot) == (IDLE_RSS_MB, 0.0, boot + 1)
    assert not memory.changing


def _leaky(limit_mb: int | None) -> Scenario:
    """Two alike nodes at half load; b leaks 4 MB a request from 5 s and dies at 20 s."""
    faults = (
        Fault(at=5.0, kind="leak", value=4.0),
        Fault(at=20.0, kind="crash"),
        Fault(at=25.0, kind="recover"),
    )
    spec: dict[str, Any] = {"slots": 4, "tokens_per_s": 100.0, "ttft_ms": 0.0}
    mix = PromptClass(
        name="q",
        share=1.0,
        prompt_tokens=Dist(kind="fixed", mean=10),
        max_tokens=Dist(kind="fixed", mean=100),
    )
    return Scenario(
        name="leak",
        duration=30.0,
        seed=1,
        nodes=(
            NodeSpec(name="a", **spec),
            NodeSpec(name="b", **spec, faults=faults, memory_limit_mb=limit_mb),
        ),
        workload=Workload(rate=4.0, mix=(mix,)),
    )


@pytest.mark.parametrize("strategy", ["round_robin", "predictive"])
def test_a_node_leaking_towards_its_limit_is_drained_before_it_dies(strategy: str) -> None:
    """As the live gateway drains it (seed-3am's node C, a second into its leak): nothing is
    in flight on it when it crashes. Without a limit to project against, it is not drained."""
    runs = {}
    for limit in (300, None):
        scenario = _leaky(limit)
        runs[limit] = simulate(
            scenario.nodes,
            scenario.arrivals(),
            strategy,
            duration=scenario.duration,
            params=SimParams(replicas=2),
        )
    assert runs[300].errors.get("crash", 0) == 0
    assert runs[None].errors.get("crash", 0) > 0
    # Back after its restart (a new process, a new boot): it takes its share again.
    assert runs[300].dispatched[1] > 0.25 * runs[None].dispatched[1]
