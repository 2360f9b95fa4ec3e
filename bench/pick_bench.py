"""Pick cost per strategy at 10, 100 and 1,000 nodes.

Prints a table and writes bench/results/pick.json. Goals (issue 3): <= 20 us per p2c pick at
1,000 nodes, <= 200 us for the strategies that scan every candidate. Run: `make bench` or
`python bench/pick_bench.py [--quick]`; it takes a few seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import time
import timeit
import tracemalloc
from collections.abc import Callable
from functools import partial
from typing import Any

from promptlb.bench._report import RESULTS, environment
from promptlb.middleware._predictive import Predictive
from promptlb.middleware._prefix import PrefixIndex, prompt_blocks
from promptlb.middleware._rendezvous import first_choice
from promptlb.middleware._scoring import Resource
from promptlb.middleware._strategies import make_strategy
from promptlb.middleware._view import NodeView, RouteRequest
from promptlb.shared import EngineSample, GpuSample, Snapshot, prompt_bytes

SIZES = (10, 100, 1_000)
P2C_GOAL_US = 20.0
SCAN_GOAL_US = 200.0

# (label, strategy name, options, goal at 1,000 nodes or None, what the row measures)
CASES: list[tuple[str, str, dict[str, Any], float | None, str]] = [
    ("round_robin", "round_robin", {}, P2C_GOAL_US, "no scan; held to the O(1) goal"),
    # Smooth round robin scans every node up to 64; above, a weighted draw from cumulative
    # weights rebuilt every 64 picks (the rebuild's scan is in the mean).
    ("weighted", "weighted", {}, SCAN_GOAL_US, "scan up to 64, a weighted draw above"),
    (
        "weighted dynamic",
        "weighted",
        {"dynamic_weights": True},
        SCAN_GOAL_US,
        "scan up to 64, a weighted draw above",
    ),
    ("least_conn", "least_conn", {}, SCAN_GOAL_US, "a sample of 64 (full scan up to 64)"),
    ("least_conn full", "least_conn", {"sample": 1_000}, SCAN_GOAL_US, "full scan (sample=1000)"),
    ("resource", "resource", {}, SCAN_GOAL_US, "a sample of 64, scores cached per snapshot"),
    # Each node's score is recomputed once per new snapshot (about 1 Hz), not per pick: this
    # row is the worst case, the first pick after every node's snapshot changed at once.
    ("resource cold", "resource", {}, None, "full scan, every score recomputed"),
    ("p2c", "p2c", {}, P2C_GOAL_US, "two candidates"),
]


def fleet(n: int, rng: random.Random) -> list[NodeView]:
    """``n`` nodes as a busy cluster shows them: 1-8 GPUs each, engines with work, a few nodes
    warming (ramp < 1), a few without a fresh snapshot and some without engine metrics."""
    nodes: list[NodeView] = []
    now = time.time()
    for i in range(n):
        name = f"gpu-node-{i:04d}.cluster.local"
        gpus = tuple(
            GpuSample(g, rng.random(), rng.randrange(10_000, 81_559), 81_559, 65, 300)
            for g in range(rng.randint(1, 8))
        )
        engine = (
            EngineSample(
                running=rng.randrange(0, 32),
                waiting=rng.randrange(0, 8),
                kv_cache=rng.random(),
                tps=rng.uniform(100.0, 2_000.0),
            )
            if rng.random() < 0.9
            else None
        )
        snapshot = Snapshot(
            node=name,
            boot="9f2c4e1a7b3d5e60",
            seq=rng.randrange(1, 100_000),
            ts=now,
            ready=True,
            warm=True,
            models=("llama-3.1-70b-instruct",),
            cpu=rng.random(),
            mem=rng.random(),
            gpus=gpus,
            engine=engine,
        )
        nodes.append(
            NodeView(
                name=name,
                url=f"http://{name}:8000",
                weight=rng.choice((1.0, 1.0, 2.0, 4.0)),
                snapshot=snapshot if rng.random() < 0.97 else None,
                in_flight=rng.randrange(0, 6),
                in_flight_at_snapshot=rng.randrange(0, 4),
                ramp=1.0 if rng.random() < 0.95 else rng.uniform(0.1, 1.0),
            )
        )
    return nodes


def per_pick_us(fn: Callable[[], object], repeat: int, budget_s: float) -> float:
    """The least disturbed of ``repeat`` runs, each sized to about ``budget_s``."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    number = max(10, min(200_000, int(budget_s / once)))
    return min(timeit.repeat(fn, repeat=repeat, number=number)) / number * 1e6


def cold_resource_pick(
    request: RouteRequest, nodes: list[NodeView], rng: random.Random
) -> NodeView:
    # A fresh instance has an empty cache: every score is computed, as on the first pick after
    # every node sent a new snapshot at once.
    return Resource(sample=len(nodes)).pick(request, nodes, rng)


def run(repeat: int, budget_s: float) -> list[dict[str, Any]]:
    rng = random.Random(1234)
    request = RouteRequest(model="llama-3.1-70b-instruct", input_tokens=512, max_tokens=256)
    rows: list[dict[str, Any]] = []
    for size in SIZES:
        nodes = fleet(size, rng)
        for label, name, options, goal, what in CASES:
            pick_rng = random.Random(size)
            fn: Callable[[], object]
            if label == "resource cold":
                fn = partial(cold_resource_pick, request, nodes, pick_rng)
            else:
                fn = partial(make_strategy(name, **options).pick, request, nodes, pick_rng)
            us = per_pick_us(fn, repeat, budget_s)
            row: dict[str, Any] = {"strategy": label, "nodes": size, "us_per_pick": us}
            if size == SIZES[-1] and goal is not None:
                row["goal_us"] = goal
                row["meets_goal"] = us <= goal
            row["measures"] = what
            rows.append(row)
    return rows


CACHE_NODES = 64
CACHE_PROMPT_TOKENS = 8_000
CACHE_GOAL_US = 50.0


def cache_aware(repeat: int, budget_s: float) -> dict[str, Any]:
    """Cache-aware predictive at 64 nodes for an 8,000-token chat: the route's hashing (the
    prompt as the engine sees it, its coarse blocks) plus the pick with a warm index (every node
    holds the shared system prompt, a few hold this conversation), the record included; and
    the index's memory per entry, for the bound at 1,000 nodes."""
    rng = random.Random(99)
    nodes = fleet(CACHE_NODES, rng)
    system = "You are the assistant of tenant 42. " * 440  # ~16,000 bytes: 4,000 tokens
    history = "".join(f"turn {i}: a question and its long answer. " * 20 for i in range(20))
    body = {
        "model": "llama-3.1-70b-instruct",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": history[: CACHE_PROMPT_TOKENS * 4 - len(system) - 64]},
        ],
    }
    strategy = make_strategy("predictive")
    assert isinstance(strategy, Predictive)
    for view in nodes:  # learnt: every node warm
        for i in range(6):
            learn = RouteRequest(model="m", input_tokens=500 + 700 * i, max_tokens=64)
            strategy.observe(learn, view, 1.0 + 0.0004 * i * 700, None, 0)
    shared = prompt_blocks(prompt_bytes({"messages": body["messages"][:1]}))
    index = strategy.index
    assert index is not None
    for view in nodes:
        index.record(view, shared, 1)
    for view in nodes[:4]:
        index.record(view, prompt_blocks(prompt_bytes(body)), 1)
    pick_rng = random.Random(5)

    def hash_and_pick() -> NodeView:
        blocks = prompt_blocks(prompt_bytes(body))
        # Built whole, as the request reader builds it: dataclasses.replace is 3 us of its own.
        request = RouteRequest(
            model="m", input_tokens=CACHE_PROMPT_TOKENS, max_tokens=256, blocks=blocks
        )
        return strategy.pick(request, nodes, pick_rng)

    us = per_pick_us(hash_and_pick, repeat, budget_s)
    hashing = per_pick_us(lambda: prompt_blocks(prompt_bytes(body)), repeat, budget_s)
    # Memory: fill a fresh index and weigh it.
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    fill = PrefixIndex(capacity=1_000)
    views = [NodeView(name=f"gpu-node-{i:04d}.cluster.local", url="") for i in range(50)]
    for i in range(50_000):
        fill.record(views[i % 50], (rng.getrandbits(32),), i)
    per_entry = (tracemalloc.get_traced_memory()[0] - before) / len(fill)
    tracemalloc.stop()
    default = PrefixIndex().capacity
    return {
        "nodes": CACHE_NODES,
        "prompt_tokens": CACHE_PROMPT_TOKENS,
        "coarse_blocks": len(prompt_blocks(prompt_bytes(body))),
        "us_hash_and_pick": us,
        "us_hashing": hashing,
        "goal_us": CACHE_GOAL_US,
        "meets_goal": us <= CACHE_GOAL_US,
        "index_bytes_per_entry": round(per_entry),
        "index_default_capacity_per_node": default,
        "index_mb_at_1000_nodes_full": round(per_entry * default * 1000 / 2**20),
    }


def new_prefix(repeat: int, budget_s: float) -> dict[str, float]:
    """Where a prefix no node holds starts (`first_choice`, run for every candidate list at
    each such pick, however few the pick samples): per call, a new prefix each, by fleet size.
    Every candidate was scored once: 0.8 ms at 1,000 nodes."""
    out: dict[str, float] = {}
    for n in SIZES:
        views = [NodeView(name=f"gpu-node-{i:04d}.cluster.local", url="") for i in range(n)]
        call = partial(_first_choice_of_next, itertools.count(1), views)
        out[f"{n}_nodes"] = per_pick_us(call, repeat, budget_s)
    return out


def _first_choice_of_next(keys: itertools.count[int], views: list[NodeView]) -> NodeView:
    return first_choice(next(keys), views)


def table(rows: list[dict[str, Any]]) -> str:
    labels = [case[0] for case in CASES]
    by = {(r["strategy"], r["nodes"]): r for r in rows}
    head = f"{'strategy':<18}" + "".join(f"{f'{n:,} nodes':>13}" for n in SIZES)
    lines = [head + f"{'goal @1,000':>14}  ", "-" * (len(head) + 20)]
    for label in labels:
        cells = "".join(f"{by[label, n]['us_per_pick']:>10.2f} us" for n in SIZES)
        last = by[label, SIZES[-1]]
        if "goal_us" in last:
            goal = f"<= {last['goal_us']:.0f} us"
            verdict = "ok" if last["meets_goal"] else "MISSED"
        else:
            goal, verdict = "-", "(worst case, once per snapshot)"
        lines.append(f"{label:<18}{cells}{goal:>14}  {verdict}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run, for smoke tests")
    args = parser.parse_args()
    repeat, budget_s = (3, 0.01) if args.quick else (7, 0.1)
    began = time.perf_counter()
    rows = run(repeat, budget_s)
    cached = cache_aware(repeat, budget_s)
    cached["us_new_prefix_first_choice"] = new_prefix(repeat, budget_s)
    report: dict[str, Any] = {
        "benchmark": "pick",
        **environment(),  # commit, dirty, when, python, cores: what was measured, where
        "machine": platform.machine(),
        "goals_us_at_1000_nodes": {"p2c": P2C_GOAL_US, "full_scan": SCAN_GOAL_US},
        "method": "timeit, min of repeats, per pick; nodes with 1-8 GPUs and engine load",
        "results": rows,
        "cache_aware": cached,
        "seconds": time.perf_counter() - began,
    }
    print(table(rows))
    print(
        f"cache-aware predictive, {cached['nodes']} nodes, {cached['prompt_tokens']:,}-token "
        f"prompt: {cached['us_hash_and_pick']:.1f} us a pick with hashing "
        f"({cached['us_hashing']:.1f} us of it hashing; goal <= {CACHE_GOAL_US:.0f} us: "
        f"{'ok' if cached['meets_goal'] else 'MISSED'}); index {cached['index_bytes_per_entry']}"
        f" bytes an entry, {cached['index_mb_at_1000_nodes_full']} MB at 1,000 nodes full"
    )
    spots = cached["us_new_prefix_first_choice"]
    print(
        "where a new prefix starts (rendezvous): "
        + ", ".join(f"{us:.1f} us at {n.split('_')[0]} nodes" for n, us in spots.items())
    )
    # A quick run goes under quick/, as every other bench's: it overwrote the committed file.
    out = RESULTS / "quick" / "pick.json" if args.quick else RESULTS / "pick.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} ({report['seconds']:.1f} s)")


if __name__ == "__main__":
    main()
