"""A simulated request's tries: retries within the middleware's budget, and what counts
against a node."""

from __future__ import annotations

import math

import pytest
from promptlb.bench._scenario import Arrival, Fault, NodeSpec
from promptlb.bench._simcore import SimParams, _Sim, simulate
from promptlb.shared import ConfigError


def test_a_retry_holds_its_place_in_the_budget_until_its_headers_come() -> None:
    # Node c crashes with ten tries waiting for their first token; twenty are active, so the
    # budget (20%, at least 3) lets 4 retry at once, as Balancer.open keeps a retry counted
    # until its node answers. The place was given back when the retry took a slot on b, so
    # a burst of resets was never held to the budget (all ten retried).
    nodes = [
        NodeSpec(name="b", slots=16, tokens_per_s=10.0, ttft_ms=400.0),
        NodeSpec(
            name="c",
            slots=16,
            tokens_per_s=10.0,
            ttft_ms=5000.0,
            faults=(Fault(at=1.0, kind="crash"),),
        ),
    ]
    arrivals = [Arrival(i * 0.001, "q", 1, 10) for i in range(20)]
    params = SimParams(replicas=1)
    result = simulate(nodes, arrivals, "round_robin", duration=10.0, params=params)
    assert result.retries == 4
    assert result.ok == 14 and result.failed == 6


def test_a_try_the_client_gave_up_on_counts_against_no_node() -> None:
    # The client's 50 s ran out while a retry waited on a busy node: the gateway cancels the
    # try (an abort), where it was recorded as that node's failure, toward its ejection.
    nodes = [
        NodeSpec(name="a", slots=1, tokens_per_s=1.0, ttft_ms=0.0),
        NodeSpec(
            name="b", slots=1, tokens_per_s=10.0, ttft_ms=0.0, faults=(Fault(at=0.0, kind="hang"),)
        ),
    ]
    # The first goes to b, hangs there for its 30 s try and is retried on a, where it queues
    # behind the second (100 s of work) until its client gives up at 50 s.
    arrivals = [Arrival(0.0, "q", 1, 10), Arrival(0.1, "q", 1, 100)]
    params = SimParams(replicas=1, client_timeout=50.0)
    sim = _Sim(nodes, arrivals, "round_robin", 1.0, params, {}, None)
    result = sim.run()
    assert result.errors == {"timeout": 2} and result.retries == 1  # the second is cut at 50 s
    assert result.dispatched == [2, 1]
    replica = sim.replicas[0]
    assert replica.consecutive == [0, 1]  # b's own timeout; none on a
    assert replica.views[0].error_rate == 0.0 < replica.views[1].error_rate


def test_no_timeout_at_all_with_a_hang_fault_is_refused() -> None:
    # A try on the hung node never ended, and the run with it.
    hung = NodeSpec(
        name="a", slots=1, tokens_per_s=10.0, ttft_ms=0.0, faults=(Fault(at=0.0, kind="hang"),)
    )
    params = SimParams(per_try_timeout=math.inf, client_timeout=math.inf)
    with pytest.raises(ConfigError, match="client_timeout"):
        simulate([hung], [Arrival(0.0, "q", 1, 10)], "round_robin", duration=1.0, params=params)


@pytest.mark.parametrize("strategy", ["round_robin", "perfect"])
def test_a_prompt_and_answer_past_the_nodes_context_is_a_400_at_once(strategy: str) -> None:
    """As the emulator answers (its context is its KV cache's tokens, 4 blocks of 16 here): the
    request's fault, passed on, never retried elsewhere, and no failure of the node's. The
    simulator served it as any other."""
    small = [
        NodeSpec(name=name, slots=2, tokens_per_s=10.0, ttft_ms=0.0, kv_blocks=4) for name in "ab"
    ]
    arrivals = [Arrival(i * 0.5, "q", 50, 10) for i in range(2)]  # 60 tokens: they fit
    arrivals += [Arrival(1.0 + i * 0.5, "q", 50, 20) for i in range(6)]  # 70: they do not
    sim = _Sim(small, arrivals, strategy, 10.0, SimParams(replicas=1), {}, None)
    result = sim.run()
    assert result.errors == {"bad_request": 6} and result.ok == 2
    assert result.retries == 0 and sum(result.dispatched) == 8
    if strategy != "perfect":
        assert sim.replicas[0].consecutive == [0, 0] and result.ejections == 0
    # At the edge, the prompt as the emulator counts the body (its chat template's tokens
    # more): 50 + 13 fit by the arrival's count, and not by the engine's 52 + 13.
    edge = [Arrival(0.0, "q", 50, 13), Arrival(0.1, "q", 50, 12)]
    result = _Sim(small, edge, strategy, 10.0, SimParams(replicas=1), {}, None).run()
    assert result.errors == {"bad_request": 1} and result.ok == 1


def test_the_strategy_is_told_of_a_nodes_refusals_as_the_balancer_tells_it() -> None:
    # A node whose context no prompt fits answers 400 at once: the balancer tells the strategy
    # (`Strategy.refused`), and predictive lets it sit out; the simulator told it nothing, and
    # it took 288 of 294 requests there, every one refused.
    nodes = [
        NodeSpec(name="big", slots=16, tokens_per_s=100.0, ttft_ms=50.0),
        NodeSpec(name="small", slots=16, tokens_per_s=100.0, ttft_ms=50.0, kv_blocks=64),
    ]
    arrivals = [Arrival(i * 0.1, "long", 2000, 50) for i in range(300)]
    result = simulate(nodes, arrivals, "predictive", duration=30.0, params=SimParams(replicas=1))
    assert result.errors.get("bad_request", 0) <= 60, result.errors
    assert result.ok >= 240
