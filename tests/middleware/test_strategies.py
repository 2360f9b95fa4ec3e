"""Each strategy's pick logic: distribution, weights, ramp, ties, unknown load and the empty set."""

from __future__ import annotations

import pickle
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, overload

import pytest
from promptlb.middleware._refusals import NoNodeAvailable
from promptlb.middleware._scoring import PowerOfTwoChoices, Resource, resource_score, score_parts
from promptlb.middleware._simple import LeastConn, RoundRobin, Weighted
from promptlb.middleware._strategies import DEFAULT_STRATEGY, STRATEGIES, make_strategy
from promptlb.middleware._strategy import FORGET_SPAN as _FORGET_SPAN
from promptlb.middleware._strategy import (
    ResourceWeights,
    Strategy,
    sample_of,
)
from promptlb.middleware._view import NodeView, RouteRequest

from tests.middleware.conftest import MakeNode, MakeSnapshot

REQUEST = RouteRequest(model="llama-3.1-8b")


@pytest.fixture
def idle(node: MakeNode) -> MakeNode:
    """A node whose snapshot reports no load at all."""

    def make(name: str, **kwargs: Any) -> NodeView:
        return node(name, gpus=[0.0], cpu=0.0, mem=0.0, running=0, **kwargs)

    return make


@pytest.fixture
def busy(node: MakeNode) -> MakeNode:
    """A node loaded to ``level`` on every part of the resource score."""

    def make(name: str, level: float = 0.5, **kwargs: Any) -> NodeView:
        return node(name, gpus=[level, level], cpu=level, mem=level, running=8, **kwargs)

    return make


def picks(strategy: Strategy, nodes: Sequence[NodeView], n: int, seed: int = 0) -> Counter[str]:
    rng = random.Random(seed)
    return Counter(strategy.pick(REQUEST, nodes, rng).name for _ in range(n))


def first_picks(name: str, nodes: Sequence[NodeView], seeds: int = 200) -> Counter[str]:
    """The first pick of a fresh strategy under each of ``seeds`` seeds."""
    return Counter(
        make_strategy(name).pick(REQUEST, nodes, random.Random(seed)).name for seed in range(seeds)
    )


# -- every strategy -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_an_empty_candidate_set_raises_no_node_available_naming_the_model(name: str) -> None:
    with pytest.raises(NoNodeAvailable, match=re.escape("llama-3.1-8b")) as caught:
        make_strategy(name).pick(REQUEST, [], random.Random(0))
    assert caught.value.model == "llama-3.1-8b"


def test_no_node_available_survives_pickling() -> None:
    error = pickle.loads(pickle.dumps(NoNodeAvailable("m", "all nodes ejected")))
    assert (error.model, error.reason) == ("m", "all nodes ejected")
    assert str(error) == "no node available for model 'm': all nodes ejected"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_single_candidate_is_always_picked(name: str, busy: MakeNode) -> None:
    only = busy("only", 0.9)
    assert picks(make_strategy(name), [only], 20) == {"only": 20}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_ties_are_broken_at_random_not_by_list_order(name: str, busy: MakeNode) -> None:
    nodes = [busy("a", 0.3), busy("b", 0.3), busy("c", 0.3)]
    seen = first_picks(name, nodes)
    assert set(seen) == {"a", "b", "c"}
    assert all(count > 30 for count in seen.values()), seen


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_is_a_fresh_object_with_its_config_name(name: str) -> None:
    one, two = make_strategy(name), make_strategy(name)
    assert one.name == name
    assert one is not two


# -- round_robin ----------------------------------------------------------------------------


def test_round_robin_spreads_evenly_in_turn_whatever_the_load(
    idle: MakeNode, busy: MakeNode
) -> None:
    nodes = [busy("a", 0.9), idle("b"), busy("c", 0.1, weight=5.0)]
    strategy = RoundRobin()
    rng = random.Random(3)
    order = [strategy.pick(REQUEST, nodes, rng).name for _ in range(300)]
    assert Counter(order) == {"a": 100, "b": 100, "c": 100}
    start = "abc".index(order[0])
    assert order[:6] == ["abc"[(start + i) % 3] for i in range(6)]


def test_round_robin_starts_at_a_random_offset(idle: MakeNode) -> None:
    assert set(first_picks("round_robin", [idle("a"), idle("b"), idle("c")])) == {"a", "b", "c"}


def test_round_robin_follows_a_changing_candidate_set(idle: MakeNode) -> None:
    strategy = RoundRobin()
    rng = random.Random(0)
    five = [idle(n) for n in "abcde"]
    for _ in range(4):
        strategy.pick(REQUEST, five, rng)
    two = five[:2]
    assert Counter(strategy.pick(REQUEST, two, rng).name for _ in range(10)) == {"a": 5, "b": 5}


def test_round_robin_takes_turns_per_model_when_models_alternate(idle: MakeNode) -> None:
    """One counter over every list: a RAG app's embeddings call then its chat call, two nodes
    each, sent every embeddings request to one node and every chat to one, for good."""
    strategy = RoundRobin()
    rng = random.Random(1)
    embed, chat = [idle("e1"), idle("e2")], [idle("c1"), idle("c2")]
    got: Counter[str] = Counter()
    for _ in range(100):
        got[strategy.pick(RouteRequest(model="embed"), embed, rng).name] += 1
        got[strategy.pick(RouteRequest(model="chat"), chat, rng).name] += 1
    assert got == {"e1": 50, "e2": 50, "c1": 50, "c2": 50}


# -- weighted -------------------------------------------------------------------------------


def test_weighted_gives_nginx_smooth_sequence_for_5_1_1(idle: MakeNode) -> None:
    nodes = [idle("a", weight=5.0), idle("b", weight=1.0), idle("c", weight=1.0)]
    cycles: Counter[str] = Counter()
    for seed in range(50):
        strategy = Weighted()
        rng = random.Random(seed)
        sequence = "".join(strategy.pick(REQUEST, nodes, rng).name for _ in range(21))
        cycles.update(sequence[i : i + 7] for i in range(0, 21, 7))
    # nginx's sequence is a a b a c a a. Its third pick is a tie between b and c, which nginx
    # breaks by list order and we at random: hence its mirror image, about as often.
    assert set(cycles) == {"aabacaa", "aacabaa"}
    assert min(cycles.values()) > 50


def test_weighted_shares_follow_the_weights_exactly(idle: MakeNode) -> None:
    nodes = [idle("a", weight=3.0), idle("b", weight=2.0), idle("c", weight=1.0)]
    assert picks(Weighted(), nodes, 600) == {"a": 300, "b": 200, "c": 100}


def test_weighted_ramp_reduces_a_warming_nodes_share(idle: MakeNode) -> None:
    nodes = [idle("a"), idle("b", ramp=0.5)]
    assert picks(Weighted(), nodes, 300) == {"a": 200, "b": 100}


def test_weighted_keeps_shares_while_another_models_candidates_interleave(idle: MakeNode) -> None:
    strategy = Weighted()
    rng = random.Random(0)
    big = [idle("a", weight=2.0), idle("b", weight=1.0)]
    other = [idle("x"), idle("y")]
    seen: Counter[str] = Counter()
    for _ in range(300):
        seen[strategy.pick(REQUEST, big, rng).name] += 1
        strategy.pick(REQUEST, other, rng)
    assert seen == {"a": 200, "b": 100}


def test_weighted_forgets_nodes_that_are_gone(idle: MakeNode) -> None:
    strategy = Weighted()
    rng = random.Random(0)
    strategy.pick(REQUEST, [idle("gone"), idle("stays")], rng)
    for _ in range(2 * _FORGET_SPAN):
        strategy.pick(REQUEST, [idle("stays")], rng)
    assert "gone" not in strategy._peers
    assert "gone" not in strategy._old_peers
    assert "stays" in strategy._peers


def test_dynamic_weights_shift_share_away_from_a_busy_gpu_but_never_to_zero(
    idle: MakeNode, busy: MakeNode
) -> None:
    nodes = [busy("hot", 1.0), idle("cool")]
    seen = picks(Weighted(dynamic_weights=True), nodes, 1_100)
    # hot's factor is clamped at min_factor 0.1 against cool's 1.0.
    assert seen["hot"] == pytest.approx(100, abs=2)
    assert seen["cool"] == pytest.approx(1_000, abs=2)
    static = picks(Weighted(), nodes, 1_100)
    assert static == {"hot": 550, "cool": 550}


def test_dynamic_weights_follow_new_snapshots_smoothly(snap: MakeSnapshot, idle: MakeNode) -> None:
    hot = NodeView(name="hot", url="http://hot", snapshot=snap("hot", gpus=[0.0]))
    cool = idle("cool")
    strategy = Weighted(dynamic_weights=True)
    rng = random.Random(0)

    def share(window: int = 1_000) -> float:
        return sum(strategy.pick(REQUEST, [hot, cool], rng) is hot for _ in range(window)) / window

    assert share() == pytest.approx(0.5, abs=0.01)
    hot.snapshot = snap("hot", gpus=[0.9], seq=2)
    # One step of the EWMA: factor 1 + 0.3 * (0.1 - 1) = 0.73, not the sample's 0.1 at once.
    assert share() == pytest.approx(0.73 / 1.73, abs=0.01)
    for seq in range(3, 30):
        hot.snapshot = snap("hot", gpus=[0.9], seq=seq)
        strategy.pick(REQUEST, [hot, cool], rng)
    assert share() == pytest.approx(0.1 / 1.1, abs=0.01)
    hot.snapshot = None  # stale: no fresh GPU data, full weight
    assert share() == pytest.approx(0.5, abs=0.01)


def test_dynamic_weights_keep_full_weight_without_gpu_data(
    snap: MakeSnapshot, idle: MakeNode
) -> None:
    cpu_only = NodeView(name="cpu", url="http://cpu", snapshot=snap("cpu", cpu=0.9, running=3))
    unknown = NodeView(name="unknown", url="http://unknown")
    seen = picks(Weighted(dynamic_weights=True), [cpu_only, unknown, idle("gpu")], 300)
    assert seen == {"cpu": 100, "unknown": 100, "gpu": 100}


def test_dynamic_weights_min_factor_is_configurable(idle: MakeNode, busy: MakeNode) -> None:
    nodes = [busy("hot", 1.0), idle("cool")]
    seen = picks(Weighted(dynamic_weights=True, min_factor=0.5), nodes, 300)
    assert seen == {"hot": 100, "cool": 200}


def test_weighted_above_64_candidates_draws_in_proportion_to_the_weights(idle: MakeNode) -> None:
    # 100 nodes: "heavy" weighs 25, "zero" 0, the other 98 weigh 1 each (a total of 123).
    nodes = [idle(f"n{i}") for i in range(98)]
    nodes += [idle("heavy", weight=25.0), idle("zero", weight=0.0)]
    seen = picks(Weighted(), nodes, 12_300)
    assert "zero" not in seen
    assert seen["heavy"] == pytest.approx(2_500, rel=0.08)
    assert seen["n0"] == pytest.approx(100, abs=40)
    # Nothing but zero weights: one of them still gets the request.
    zeros = [idle(f"z{i}", weight=0.0) for i in range(100)]
    assert sum(picks(Weighted(), zeros, 50).values()) == 50


def test_weighted_above_64_candidates_reads_the_weights_again_every_64_picks(
    idle: MakeNode,
) -> None:
    nodes = [idle(f"n{i}") for i in range(100)]
    strategy = Weighted()
    rng = random.Random(0)
    for _ in range(64):
        strategy.pick(REQUEST, nodes, rng)
    # The same list, its nodes now warming but one: after the table's next rebuild (at most 64
    # picks away) that one takes nearly everything.
    for node in nodes[1:]:
        node.ramp = 0.001
    for _ in range(64):
        strategy.pick(REQUEST, nodes, rng)
    seen = Counter(strategy.pick(REQUEST, nodes, rng).name for _ in range(1_000))
    assert seen["n0"] > 850
    # A retry's list, new each time, is drawn from its own nodes only.
    retry = nodes[1:]
    assert all(strategy.pick(REQUEST, retry, rng) is not nodes[0] for _ in range(100))
    assert len(strategy._tables) <= 64


@pytest.mark.parametrize(
    "options",
    [{"dynamic_weights": "yes"}, {"min_factor": 0}, {"min_factor": 1.5}, {"min_factor": "x"}],
)
def test_weighted_rejects_bad_options(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        make_strategy("weighted", **options)


# -- least_conn -----------------------------------------------------------------------------


def test_least_conn_picks_the_fewest_requests_per_weight(snap: MakeSnapshot) -> None:
    a = NodeView(name="a", url="http://a", snapshot=snap("a", running=6))
    b = NodeView(name="b", url="http://b", snapshot=snap("b", running=9), weight=2.0)  # 4.5
    c = NodeView(name="c", url="http://c", snapshot=snap("c", running=5))
    assert picks(LeastConn(), [a, b, c], 10) == {"b": 10}


def test_least_conn_counts_our_in_flight_on_top_of_the_others_in_the_engine(
    snap: MakeSnapshot,
) -> None:
    # a: the engine saw 4, of which 2 were ours; ours are 7 now -> 2 others + 7 = 9.
    a = NodeView(
        name="a",
        url="http://a",
        snapshot=snap("a", running=4),
        in_flight=7,
        in_flight_at_snapshot=2,
    )
    b = NodeView(name="b", url="http://b", snapshot=snap("b", running=8))
    # c: no snapshot, so the others' load there is unknown, and taken as the mean of those
    # seen ((2 + 8) / 2 = 5) beside our 8: 13, never idle.
    no_snapshot = NodeView(name="c", url="http://c", in_flight=8, in_flight_at_snapshot=0)
    assert set(picks(LeastConn(), [a, b, no_snapshot], 30)) == {"b"}


def test_least_conn_takes_a_node_without_a_snapshot_as_busy_as_the_others_seen(
    snap: MakeSnapshot,
) -> None:
    """A node whose sidecar is gone read as ours alone: nearly idle beside nodes whose queues
    showed 12 each, it drew the bulk of the traffic."""
    seen = [
        NodeView(name=f"s{i}", url="http://s", snapshot=snap(f"s{i}", running=12)) for i in range(4)
    ]
    stale = NodeView(name="stale", url="http://x")
    strategy, rng = LeastConn(), random.Random(4)
    got: Counter[str] = Counter()
    for _ in range(40):
        chosen = strategy.pick(REQUEST, [*seen, stale], rng)
        got[chosen.name] += 1
        chosen.in_flight += 1  # held: ours count on top
    assert got["stale"] <= 10, got  # its even share is 8


def test_least_conn_matches_effective_queue_over_capacity(snap: MakeSnapshot) -> None:
    rng = random.Random(7)
    strategy = LeastConn()
    for trial in range(300):
        nodes = [
            NodeView(
                name=f"n{i}",
                url="http://n",
                # no snapshot, one without engine metrics, or one with an engine queue
                snapshot=rng.choice(
                    (None, snap(f"n{i}"), snap(f"n{i}", running=rng.randrange(10)))
                ),
                weight=rng.choice((0.5, 1.0, 3.0)),
                ramp=rng.choice((0.2, 1.0)),
                in_flight=rng.randrange(6),
                in_flight_at_snapshot=rng.randrange(6),
                others_since_snapshot=rng.randrange(-3, 4),  # other replicas' since
            )
            for i in range(5)
        ]
        chosen = strategy.pick(REQUEST, nodes, rng)
        loads = [n.effective_queue / (n.weight * n.ramp) for n in nodes]
        # A node whose engine no snapshot shows carries the mean of the others seen.
        seen = [n for n in nodes if n.snapshot is not None and n.snapshot.engine is not None]
        mean = (
            sum((n.effective_queue - n.in_flight) / (n.weight * n.ramp) for n in seen) / len(seen)
            if seen
            else 0.0
        )
        loads = [load + (0.0 if n in seen else mean) for n, load in zip(nodes, loads, strict=True)]
        assert loads[nodes.index(chosen)] == pytest.approx(min(loads)), trial


def test_least_conn_ramp_reduces_share(snap: MakeSnapshot) -> None:
    warming = NodeView(name="w", url="http://w", snapshot=snap("w", running=3), ramp=0.5)  # 6
    full = NodeView(name="f", url="http://f", snapshot=snap("f", running=5))
    assert picks(LeastConn(), [warming, full], 10) == {"f": 10}


def test_least_conn_avoids_a_zero_weight_node_while_another_can_serve(snap: MakeSnapshot) -> None:
    zero = NodeView(name="z", url="http://z", weight=0.0)
    loaded = NodeView(name="l", url="http://l", snapshot=snap("l", running=50))
    assert picks(LeastConn(), [zero, loaded], 10) == {"l": 10}


def test_least_conn_sample_of_zero_weight_nodes_falls_back_to_the_others(
    snap: MakeSnapshot,
) -> None:
    # 999 zero-weight nodes and one that can serve: a sample of 64 nearly always misses it, yet
    # it must get every request.
    nodes = [NodeView(name=f"z{i}", url=f"http://z{i}", weight=0.0) for i in range(999)]
    nodes.append(NodeView(name="l", url="http://l", snapshot=snap("l", running=50)))
    assert picks(LeastConn(), nodes, 50) == {"l": 50}
    # With none that can serve, one of them still gets the request.
    assert sum(picks(LeastConn(), nodes[:-1], 20).values()) == 20


# -- resource -------------------------------------------------------------------------------


def test_resource_score_is_the_weighted_mean_of_its_parts(snap: MakeSnapshot) -> None:
    node = NodeView(
        name="n", url="http://n", snapshot=snap("n", gpus=[0.4, 0.6], cpu=0.2, mem=0.4, running=8)
    )
    # 0.4 * 0.5 + 0.3 * 0.2 + 0.2 * 0.4 + 0.1 * 8 / (8 + 8)
    assert resource_score(node) == pytest.approx(0.39)
    parts = score_parts(node)
    assert parts.known
    assert parts.gpu == pytest.approx(0.5)
    assert (parts.cpu, parts.mem, parts.queue) == (0.2, 0.4, 8)
    assert parts.queue_norm == pytest.approx(0.5)
    assert parts.score == pytest.approx(0.39)
    assert parts.cost == pytest.approx(parts.score)


def test_resource_score_renormalises_the_weights_of_missing_parts(snap: MakeSnapshot) -> None:
    no_gpus = NodeView(name="n", url="http://n", snapshot=snap("n", cpu=0.2, mem=0.4, running=8))
    assert resource_score(no_gpus) == pytest.approx((0.06 + 0.08 + 0.05) / 0.6)
    no_engine = NodeView(name="n", url="http://n", snapshot=snap("n", gpus=[1.0], cpu=1.0))
    assert resource_score(no_engine) == pytest.approx(1.0)
    assert score_parts(no_engine).queue is None
    nothing = NodeView(name="n", url="http://n", snapshot=snap("n"))
    assert resource_score(nothing, unknown_score=0.6) == 0.6


def test_resource_score_queue_scale_and_override(snap: MakeSnapshot) -> None:
    node = NodeView(name="n", url="http://n", snapshot=snap("n", running=2))
    weights = ResourceWeights(gpu=0, cpu=0, mem=0, queue=1)
    assert resource_score(node, weights, queue_scale=2.0) == pytest.approx(0.5)
    assert resource_score(node, weights, queue_scale=2.0, queue=6) == pytest.approx(0.75)


def test_score_parts_agree_with_resource_score(snap: MakeSnapshot) -> None:
    rng = random.Random(11)
    for _ in range(200):
        snapshot = snap(
            "n",
            gpus=[rng.random() for _ in range(rng.randrange(4))],
            cpu=rng.choice((None, rng.random())),
            mem=rng.choice((None, rng.random())),
            running=rng.choice((None, rng.randrange(20))),
        )
        node = NodeView(name="n", url="http://n", snapshot=rng.choice((None, snapshot)))
        node.ramp = rng.choice((0.25, 1.0))
        queue = rng.choice((None, rng.randrange(20)))
        parts = score_parts(node, queue=queue)
        assert parts.score == resource_score(node, queue=queue)
        assert parts.cost == pytest.approx(1 - (1 - parts.score) * node.ramp)


def test_resource_picks_the_lowest_score(busy: MakeNode) -> None:
    nodes = [busy("a", 0.6), busy("b", 0.2), busy("c", 0.9)]
    assert picks(Resource(), nodes, 10) == {"b": 10}


def test_resource_does_not_take_an_unknown_node_for_an_idle_one(
    idle: MakeNode, busy: MakeNode
) -> None:
    unknown = NodeView(name="unknown", url="http://unknown")
    assert picks(Resource(), [unknown, busy("light", 0.2)], 10) == {"light": 10}
    assert picks(Resource(), [unknown, idle("idle")], 10) == {"idle": 10}
    # ... nor for a full one: it scores unknown_score, between the two.
    assert picks(Resource(), [unknown, busy("heavy", 0.9)], 10) == {"unknown": 10}
    assert score_parts(unknown).score == 0.5
    assert not score_parts(unknown).known
    cautious = Resource(unknown_score=1.0)
    assert picks(cautious, [unknown, busy("heavy", 0.9)], 10) == {"heavy": 10}


def test_resource_sends_an_unknown_node_less_as_its_requests_pile_up(busy: MakeNode) -> None:
    """Its flat unknown_score stayed below every busier node's score whatever we sent it: a
    node whose sidecar was gone took every pick until its snapshots came back."""
    unknown = NodeView(name="unknown", url="http://unknown")
    others = [busy(f"b{i}", 0.7) for i in range(4)]
    strategy, rng = Resource(), random.Random(2)
    got: Counter[str] = Counter()
    for _ in range(40):
        chosen = strategy.pick(REQUEST, [unknown, *others], rng)
        got[chosen.name] += 1
        chosen.in_flight += 1
    assert 0 < got["unknown"] < 40, got


def test_resource_ramp_shrinks_the_headroom(snap: MakeSnapshot, busy: MakeNode) -> None:
    warming = busy("w", 0.3, ramp=0.5)  # cost 1 - 0.68 * 0.5 = 0.66
    full = busy("f", 0.5)
    assert picks(Resource(), [warming, full], 10) == {"f": 10}
    parts = score_parts(warming)
    assert parts.cost == pytest.approx(1 - (1 - parts.score) * 0.5)
    idle = NodeView(
        name="i", url="http://i:8000", snapshot=snap("i", cpu=0.0, mem=0.0, running=0), ramp=0.25
    )
    assert score_parts(idle).score == 0.0
    assert score_parts(idle).cost == pytest.approx(0.75)  # not 0: it is still warming


def test_resource_rescores_a_node_when_its_snapshot_changes(
    snap: MakeSnapshot, busy: MakeNode
) -> None:
    a, b = busy("a", 0.2), busy("b", 0.5)
    strategy = Resource()
    rng = random.Random(0)
    assert strategy.pick(REQUEST, [a, b], rng) is a
    a.snapshot = snap("a", gpus=[0.9], cpu=0.9, mem=0.9, running=30, seq=2)
    assert strategy.pick(REQUEST, [a, b], rng) is b
    a.snapshot = None
    b.snapshot = snap("b", gpus=[0.9], cpu=0.9, mem=0.9, running=30, seq=2)
    assert strategy.pick(REQUEST, [a, b], rng) is a


def test_resource_custom_weights_leave_unnamed_parts_out(snap: MakeSnapshot) -> None:
    gpu_heavy = NodeView(name="g", url="http://g", snapshot=snap("g", gpus=[0.9], cpu=0.0))
    cpu_heavy = NodeView(name="c", url="http://c", snapshot=snap("c", gpus=[0.1], cpu=1.0))
    assert picks(Resource(weights={"gpu": 1.0}), [gpu_heavy, cpu_heavy], 10) == {"c": 10}
    assert picks(Resource(weights={"cpu": 2}), [gpu_heavy, cpu_heavy], 10) == {"g": 10}
    assert Resource(weights={"cpu": 2}).weights == ResourceWeights(0.0, 2.0, 0.0, 0.0)
    assert Resource().weights == ResourceWeights(0.4, 0.3, 0.2, 0.1)


@pytest.mark.parametrize("name", ["resource", "p2c"])
@pytest.mark.parametrize(
    ("weights", "key"),
    [
        ({"gpu": -0.1}, "weights.gpu"),
        ({"cpu": float("inf")}, "weights.cpu"),
        ({"mem": float("nan")}, "weights.mem"),
        ({"queue": True}, "weights.queue"),
        ({"gpu": "0.4"}, "weights.gpu"),
        ({"disk": 0.5}, "weights.disk"),
        ({"gpu": 0, "cpu": 0.0}, "weights"),
        ({}, "weights"),
        ([("gpu", 1.0)], "weights"),
    ],
)
def test_bad_weights_are_rejected_naming_the_key(name: str, weights: object, key: str) -> None:
    with pytest.raises(ValueError, match=rf"^{key}: ") as caught:
        make_strategy(name, weights=weights)
    assert getattr(caught.value, "key", None) == key


@pytest.mark.parametrize(
    "options",
    [
        {"queue_scale": 0},
        {"queue_scale": -1.0},
        {"queue_scale": float("inf")},
        {"unknown_score": 0},
        {"unknown_score": 1.5},
        {"unknown_score": None},
    ],
)
def test_resource_rejects_bad_options(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        make_strategy("resource", **options)


# -- the scanning strategies' sample --------------------------------------------------------


@pytest.fixture
def one_idle_among(idle: MakeNode, busy: MakeNode) -> Callable[[int], list[NodeView]]:
    def make(n: int) -> list[NodeView]:
        return [busy(f"n{i}", 0.9) for i in range(n - 1)] + [idle("lone")]

    return make


@pytest.mark.parametrize("name", ["least_conn", "resource"])
def test_a_scan_up_to_sample_nodes_is_exact(
    name: str, one_idle_among: Callable[[int], list[NodeView]]
) -> None:
    counts = picks(make_strategy(name), one_idle_among(64), 300)
    assert counts == Counter({"lone": 300})


@pytest.mark.parametrize("name", ["least_conn", "resource"])
def test_above_sample_nodes_a_random_sample_is_scanned(
    name: str, one_idle_among: Callable[[int], list[NodeView]]
) -> None:
    # The lone idle node is found exactly when it is among the 64 drawn. Up to 4 x 64 nodes they
    # are drawn without replacement: 64/65 and 64/256 of picks.
    share = picks(make_strategy(name), one_idle_among(65), 2_000)["lone"] / 2_000
    assert share > 0.97
    share = picks(make_strategy(name), one_idle_among(256), 4_000)["lone"] / 4_000
    assert 0.22 < share < 0.28
    # Above, with replacement: 1 - (999/1000)**64 = 6.2%.
    share = picks(make_strategy(name), one_idle_among(1000), 4_000)["lone"] / 4_000
    assert 0.045 < share < 0.08
    assert picks(make_strategy(name, sample=256), one_idle_among(256), 200)["lone"] == 200


@pytest.mark.parametrize("name", ["least_conn", "resource"])
@pytest.mark.parametrize("sample", [1, 0, 2.5, True, "64", None])
def test_the_sample_must_be_an_integer_of_at_least_two(name: str, sample: object) -> None:
    with pytest.raises(ValueError, match="sample"):
        make_strategy(name, sample=sample)


# -- p2c -------------------------------------------------------------------------------------


def test_p2c_picks_the_less_loaded_of_the_pair(busy: MakeNode) -> None:
    assert picks(PowerOfTwoChoices(), [busy("heavy", 0.8), busy("light", 0.3)], 50) == {"light": 50}


def test_p2c_never_picks_the_worst_and_favours_the_best(busy: MakeNode) -> None:
    nodes = [busy("best", 0.1), busy("mid", 0.5), busy("worst", 0.9)]
    seen = picks(PowerOfTwoChoices(), nodes, 3_000)
    assert "worst" not in seen
    # best wins both pairs it is in: 2/3 of the picks.
    assert seen["best"] == pytest.approx(2_000, rel=0.06)


def test_p2c_counts_requests_sent_since_the_snapshot(busy: MakeNode) -> None:
    # Identical snapshots, but 12 requests went to a since: it is the busier now.
    a = busy("a", 0.3, in_flight=12, in_flight_at_snapshot=0)
    b = busy("b", 0.3, in_flight=0)
    assert picks(PowerOfTwoChoices(), [a, b], 20) == {"b": 20}
    # resource, reading only the engine's report, sees the two alike.
    assert set(picks(Resource(), [a, b], 100)) == {"a", "b"}


def test_p2c_does_not_take_an_unknown_node_for_an_idle_one(idle: MakeNode, busy: MakeNode) -> None:
    unknown = NodeView(name="unknown", url="http://unknown")
    assert picks(PowerOfTwoChoices(), [unknown, idle("idle")], 20) == {"idle": 20}
    assert picks(PowerOfTwoChoices(), [unknown, busy("heavy", 0.9)], 20) == {"unknown": 20}


def test_p2c_ramp_reduces_share(busy: MakeNode) -> None:
    warming = busy("w", 0.3, ramp=0.5)
    full = busy("f", 0.4)
    assert picks(PowerOfTwoChoices(), [warming, full], 20) == {"f": 20}


class CountingNodes(Sequence[NodeView]):
    """A candidate list that counts how many nodes a strategy looks at."""

    def __init__(self, nodes: list[NodeView]) -> None:
        self.nodes = nodes
        self.reads = 0

    def __len__(self) -> int:
        return len(self.nodes)

    @overload
    def __getitem__(self, index: int) -> NodeView: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[NodeView]: ...
    def __getitem__(self, index: int | slice) -> NodeView | Sequence[NodeView]:
        if isinstance(index, slice):
            raise AssertionError("p2c must not copy the candidate list")
        self.reads += 1
        return self.nodes[index]


def test_p2c_looks_at_two_candidates_whatever_their_number(busy: MakeNode) -> None:
    nodes = CountingNodes([busy(f"n{i}", i / 1_000) for i in range(1_000)])
    strategy = PowerOfTwoChoices()
    rng = random.Random(0)
    for _ in range(100):
        strategy.pick(REQUEST, nodes, rng)
    assert nodes.reads == 200


# -- make_strategy --------------------------------------------------------------------------


def test_the_default_strategy_is_predictive() -> None:
    from promptlb.middleware._predictive import Predictive

    assert DEFAULT_STRATEGY == "predictive"
    assert isinstance(make_strategy(DEFAULT_STRATEGY), Predictive)
    assert set(STRATEGIES) == {
        "round_robin",
        "weighted",
        "least_conn",
        "resource",
        "p2c",
        "model_aware",
        "predictive",
    }


def test_make_strategy_passes_options() -> None:
    strategy = make_strategy("weighted", dynamic_weights=True, min_factor=0.2)
    assert isinstance(strategy, Weighted)
    assert (strategy.dynamic_weights, strategy.min_factor) == (True, 0.2)
    scored = make_strategy("p2c", weights={"gpu": 1}, queue_scale=4, unknown_score=0.8)
    assert isinstance(scored, PowerOfTwoChoices)
    assert (scored.weights.gpu, scored.queue_scale, scored.unknown_score) == (1.0, 4.0, 0.8)


def test_make_strategy_rejects_an_unknown_name_listing_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="fastest") as caught:
        make_strategy("fastest")
    for name in STRATEGIES:
        assert name in str(caught.value)


def test_make_strategy_rejects_an_unknown_option() -> None:
    with pytest.raises(ValueError, match=r"dynamic_weights.*least_conn"):
        make_strategy("least_conn", dynamic_weights=True)
    with pytest.raises(ValueError, match=r"queue_scale.*dynamic_weights, min_factor"):
        make_strategy("weighted", queue_scale=4.0)


def test_a_sample_without_replacement_is_distinct_and_uniform(node: MakeNode) -> None:
    nodes = [node(f"n{i}") for i in range(40)]
    rng = random.Random(3)
    seen: Counter[str] = Counter()
    for _ in range(4_000):
        looked = sample_of(nodes, 16, rng)
        names = [view.name for view in looked]
        assert len(names) == 16 == len(set(names))
        seen.update(names)
    # Each node is drawn 16/40 of the time: 1,600 of 4,000, within five standard deviations.
    assert all(1_450 < seen[f"n{i}"] < 1_750 for i in range(40)), seen
