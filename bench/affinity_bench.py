"""Session affinity against plain p2c, on emulators with a prefix cache.

Four emulators (8 slots, 60 ms TTFT plus prefill at 800 prompt tokens/s for what the node's KV
cache lacks, 400 blocks of 16 tokens of KV each) behind three gateways: ``p2c``, ``p2c`` with
``[affinity]`` (its default epsilon 0.25), and the same with epsilon 1 (a looser load bound,
fewer spills). All get the same open-loop workload, one after the other: Poisson arrivals at
about 60% of the cluster's capacity (counted with every request a miss), each request a turn of
one of N conversations chosen by a Zipf law (a few hot sessions, many cold ones), streamed, with
``user`` set to the session. A conversation is a session-specific system prompt (longer than the
512-character prefix) and its growing history, so every turn after the first can reuse the
prefix, if it reaches a node that still holds it.

A node's cache holds about 16 conversations against 40 sessions: a KV cache is finite, and with
plain p2c every node sees every session, so they evict each other. Each run salts its prompts
so that it starts cold, whatever the run before it left in the caches.

Reports per gateway: TTFT p50/p90/p99 (time to the first streamed chunk), the prefix-cache hit
rate (cached prompt tokens over prompt tokens, from the emulators' counters, before and after),
requests per node, and the load balance:
requests open at each node (running + waiting, sampled every 250 ms) as max/avg against the
bound 1 + epsilon. Prints a table and writes bench/results/affinity.json (``--quick``: a short
run, written under bench/results/quick/).
"""
# Over 350 lines: one benchmark's cluster, workload, measurement and report; a third of it is
# the docstring above.

from __future__ import annotations

import argparse
import asyncio
import math
import random
import tempfile
import time
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from promptlb.bench._report import RESULTS, environment, write_json
from promptlb.bench._stats import percentile
from promptlb.emulator import Service, start_service

NODES = 4
SLOTS = 8
TTFT_MS = 60.0
PREFILL_TOKENS_PER_S = 800.0
TOKENS_PER_S = 100.0
OUTPUT_TOKENS = 16
KV_BLOCKS = 400
PROMPT_TOKENS = 200  # a turn's prompt, about: the system prompt and the rolling history
EPSILON = 0.25  # affinity's default
# Plain p2c, affinity with its default bound, and a loose bound: the price of a tight one.
RUNS: tuple[tuple[str, float | None], ...] = (
    ("p2c", None),
    ("p2c+affinity", EPSILON),
    ("p2c+affinity e=1", 1.0),
)
SAMPLE_S = 0.25
MAX_TURNS = 12  # history kept: the prefix stays, the tail rolls, bodies stay small
MODEL = "m"


def system_prompt(session: int, salt: str) -> str:
    # The session first: prompts of different sessions differ within the prefix.
    return (
        f"[{salt}] Session {session}: you are the support assistant of customer {session}. "
        + f"Their account notes: plan {session % 7}, region {session % 5}, seats {session}. " * 12
    )  # about 700 characters: every turn, the first included, fills the 512-character prefix


class Conversation:
    def __init__(self, session: int, salt: str) -> None:
        self.user = f"session-{salt}-{session}"
        self.system = {"role": "system", "content": system_prompt(session, salt)}
        self.history: list[dict[str, str]] = []
        self.turn = 0

    def next_body(self) -> dict[str, Any]:
        self.turn += 1
        question = {
            "role": "user",
            "content": f"Question {self.turn}: what about item {self.turn}?",
        }
        messages = [self.system, *self.history[-2 * MAX_TURNS :], question]
        self.history += [question, {"role": "assistant", "content": f"Answer {self.turn}. " * 6}]
        return {
            "model": MODEL,
            "messages": messages,
            "max_tokens": OUTPUT_TOKENS,
            "stream": True,
            "user": self.user,
        }


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


async def emulator_stats(http: aiohttp.ClientSession, nodes: dict[str, Service]) -> dict[str, Any]:
    out = {}
    for name, service in nodes.items():
        async with http.get(service.url + "/_emulator/stats") as response:
            out[name] = await response.json()
    return out


async def open_requests(http: aiohttp.ClientSession, service: Service) -> int:
    async with http.get(service.url + "/metrics") as response:
        text = await response.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            total += sum(s.value for s in family.samples)
    return int(total)


async def drive(
    gateway: Service,
    nodes: dict[str, Service],
    *,
    sessions: int,
    rate: float,
    duration: float,
    zipf: float,
    seed: int,
    salt: str,
    epsilon: float | None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    conversations = [Conversation(i, salt) for i in range(sessions)]
    weights = zipf_weights(sessions, zipf)
    ttfts: list[float] = []
    served: dict[str, int] = {name: 0 for name in nodes}
    errors: dict[str, int] = {}
    samples: list[list[int]] = []
    url = gateway.url + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:
        before = await emulator_stats(http, nodes)

        async def one(body: dict[str, Any]) -> None:
            started = time.perf_counter()
            try:
                async with http.post(url, json=body) as response:
                    if response.status != 200:
                        errors[str(response.status)] = errors.get(str(response.status), 0) + 1
                        await response.read()
                        return
                    await response.content.readany()
                    ttfts.append(time.perf_counter() - started)
                    node = response.headers.get("x-promptlb-node", "?")
                    served[node] = served.get(node, 0) + 1
                    await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                loads = await asyncio.gather(*(open_requests(http, s) for s in nodes.values()))
                samples.append(list(loads))
                with suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SAMPLE_S)

        sampling = asyncio.create_task(sampler())
        tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        start = loop.time()
        due = start
        sent = 0
        while True:
            due += rng.expovariate(rate)
            if due - start >= duration:
                break
            await asyncio.sleep(max(0.0, due - loop.time()))
            conversation = rng.choices(conversations, weights)[0]
            task = asyncio.create_task(one(conversation.next_body()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        stop.set()
        await sampling
        after = await emulator_stats(http, nodes)
    queries = sum(
        after[n]["prefix_cache_query_tokens"] - before[n]["prefix_cache_query_tokens"]
        for n in nodes
    )
    hits = sum(
        after[n]["prefix_cache_hit_tokens"] - before[n]["prefix_cache_hit_tokens"] for n in nodes
    )
    return {
        "sent": sent,
        "ok": len(ttfts),
        "errors": errors,
        # the mean too: hits and misses sit at two levels, which percentiles only straddle
        "ttft_ms": {
            "mean": round(1000 * sum(ttfts) / max(1, len(ttfts)), 1),
            **{f"p{p}": round(1000 * (percentile(ttfts, p) or 0.0), 1) for p in (50, 90, 99)},
        },
        "prefix_cache": {
            "queries": queries,
            "hits": hits,
            "hit_rate": round(hits / queries, 4) if queries else None,
        },
        "requests_per_node": served,
        # plain p2c has no bound: measured against the default one, for comparison
        "load": balance(samples, EPSILON if epsilon is None else epsilon),
    }


def balance(samples: list[list[int]], epsilon: float) -> dict[str, Any]:
    """Requests open at each node, over the samples with at least one a node on average."""
    ratios: list[float] = []
    over = 0
    busy = [s for s in samples if sum(s) >= len(s)]
    for loads in busy:
        avg = sum(loads) / len(loads)
        ratios.append(max(loads) / avg)
        # the strategy's own bound for the request that made the busiest node's count
        if max(loads) > math.ceil((1 + epsilon) * avg - 1e-9):
            over += 1
    return {
        "samples": len(samples),
        "busy_samples": len(busy),
        "mean_open": round(sum(map(sum, samples)) / max(1, len(samples)), 2),
        "max_over_avg": {
            "p50": _round(percentile(ratios, 50)),
            "p99": _round(percentile(ratios, 99)),
            "max": _round(max(ratios) if ratios else None),
        },
        "bound": 1 + epsilon,
        "share_over_ceil_bound": round(over / len(busy), 4) if busy else None,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def gateway_config(nodes: dict[str, Service], epsilon: float | None) -> str:
    lines = ['strategy = "p2c"']
    for name, service in nodes.items():
        lines += [
            "[[nodes]]",
            f'name = "{name}"',
            f'url = "{service.url}"',
            f'models = ["{MODEL}"]',
        ]
    if epsilon is not None:
        lines += ["[affinity]", 'key = "both"', f"epsilon = {epsilon}"]
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    miss_s = TTFT_MS / 1000 + PROMPT_TOKENS / PREFILL_TOKENS_PER_S
    capacity = NODES * SLOTS / (miss_s + OUTPUT_TOKENS / TOKENS_PER_S)
    rate = args.load * capacity
    runs: dict[str, Any] = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        nodes: dict[str, Service] = {}
        for i in range(NODES):
            service = start_service(
                "emulator",
                *("--model", MODEL, "--slots", str(SLOTS), "--ttft-ms", str(TTFT_MS)),
                *("--tokens-per-s", str(TOKENS_PER_S), "--kv-blocks", str(KV_BLOCKS)),
                *("--prefill-tokens-per-s", str(PREFILL_TOKENS_PER_S), "--seed", str(i)),
            )
            stack.callback(service.stop)
            nodes[f"node-{i}"] = service
        for run, (name, epsilon) in enumerate(RUNS):
            path = Path(tmp) / f"{name}.toml"
            path.write_text(gateway_config(nodes, epsilon))
            gateway = start_service("middleware", "--config", str(path), "--log-level", "warning")
            try:
                runs[name] = await drive(
                    gateway,
                    nodes,
                    sessions=args.sessions,
                    rate=rate,
                    duration=args.duration,
                    zipf=args.zipf,
                    seed=args.seed,
                    # Of one length for every run: the names differ by up to 13 characters,
                    # and so did the prompts and their 16-token block boundaries.
                    salt=f"run{run}",
                    epsilon=epsilon,
                )
            finally:
                gateway.stop()
    return {
        "setup": {
            "nodes": NODES,
            "slots": SLOTS,
            "ttft_ms": TTFT_MS,
            "tokens_per_s": TOKENS_PER_S,
            "output_tokens": OUTPUT_TOKENS,
            "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
            "kv_blocks": KV_BLOCKS,
            "epsilon": {name: eps for name, eps in RUNS},
            "sessions": args.sessions,
            "zipf_s": args.zipf,
            "rate_rps": round(rate, 2),
            "load_of_capacity": args.load,
            "duration_s": args.duration,
            "seed": args.seed,
        },
        "runs": runs,
        "note": "client, gateways and emulators share this machine's cores; runs one after another",
    }


def table(runs: dict[str, Any]) -> str:
    head = (
        f"{'gateway':<17} {'ok':>5} {'mean':>5} {'ttft50':>7} {'ttft90':>7} {'ttft99':>7} "
        f"{'hit%':>6} "
        f"{'max/avg p50':>11} {'p99':>6} {'max':>6}  requests per node"
    )
    lines = [head, "-" * len(head)]
    for name, r in runs.items():
        t, load = r["ttft_ms"], r["load"]["max_over_avg"]
        hit = r["prefix_cache"]["hit_rate"]
        per_node = " ".join(f"{n}={c}" for n, c in sorted(r["requests_per_node"].items()))
        lines.append(
            f"{name:<17} {r['ok']:>5} {t['mean']:>5.0f} {t['p50']:>7.0f} {t['p90']:>7.0f} "
            f"{t['p99']:>7.0f} "
            f"{(hit or 0) * 100:>6.1f} {load['p50'] or 0:>11.2f} {load['p99'] or 0:>6.2f} "
            f"{load['max'] or 0:>6.2f}  {per_node}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per gateway")
    parser.add_argument("--load", type=float, default=0.6, help="share of capacity offered")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of session choice")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="8 s per gateway")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.duration = min(args.duration, 8.0)
    out = args.out or (
        RESULTS / "quick" / "affinity.json" if args.quick else RESULTS / "affinity.json"
    )
    report = {"benchmark": "affinity", **environment(), **asyncio.run(run(args))}
    print(table(report["runs"]))
    print(
        "max/avg: requests open at the busiest node over the mean, sampled at the nodes; "
        "affinity bounds it at 1 + epsilon (ceil form) when it picks, p2c does not bound it"
    )
    write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
