"""What the simulator knows of arrivals that carry their prompt (``[workload.prompts]``): each
request read as the live run's gateway and emulator read the very body the load generator sends.

* the engine's view, `emulator._prompt.prompt_blocks`: the prompt's tokens and KV block hashes;
* the gateway's view (`read`, of every arrival, filler included), `middleware._request.route_of`
  on the JSON body: ``input_tokens`` as body bytes over four and the coarse ``blocks`` of the
  prefix index; with ``[affinity]`` at its defaults, its key (`middleware._affinity.KeyMaker`)
  too.

Worked out once per sim invocation and shared by every strategy's run: a long prompt costs tens
of microseconds to hash, twice, and the same trace is replayed by every strategy.

`prefix_load` states what a trace asks of the cluster: KV demand (the blocks that will be used
again, on average over the run, against the cluster's KV capacity) and compute (slot-seconds of
work against the slots), with no cache hit and with every prefix cached after its first use.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from promptlb.emulator._config import EmulatorConfig
from promptlb.emulator._prompt import prompt_blocks
from promptlb.middleware._affinity import KeyMaker
from promptlb.middleware._config import AffinityConfig
from promptlb.middleware._request import route_of
from promptlb.middleware._view import RouteRequest
from promptlb.shared import BLOCK_TOKENS

from ._loadgen import chat_body
from ._scenario import Arrival, NodeSpec

__all__ = [
    "Prompted",
    "Read",
    "context_tokens",
    "engine_tokens",
    "kv_capacity",
    "prefix_load",
    "prepare",
    "read",
]


@dataclass(frozen=True, slots=True)
class Prompted:
    tokens: int  # the prompt's tokens, as the engine counts them
    blocks: tuple[int, ...]  # its KV block hashes, as the engine names them


@dataclass(frozen=True, slots=True)
class Read:
    route: RouteRequest  # what the gateway's strategy sees
    keyed: RouteRequest  # ... with [affinity]'s key at its defaults


def _engine(spec: NodeSpec) -> EmulatorConfig:
    """The emulator the node is, from the same flags."""
    return EmulatorConfig(slots=spec.slots, kv_blocks=spec.kv_blocks)


def kv_capacity(spec: NodeSpec) -> int:
    """The node's KV blocks, as the emulator sizes its cache."""
    return _engine(spec).kv_capacity


def context_tokens(spec: NodeSpec) -> int:
    """The node's context (prompt and answer), as the emulator bounds it."""
    return _engine(spec).context_tokens


def prepare(arrivals: Sequence[Arrival], model: str) -> list[Prompted | None]:
    """Per arrival, its prompt read by the engine; None for one without messages (filler text
    that shares no prefix with another's: the simulated engine charges its whole prefill)."""
    out: list[Prompted | None] = []
    for arrival in arrivals:
        if not arrival.messages:
            out.append(None)
            continue
        tokens, blocks = _engine_reading(arrival, model)
        out.append(Prompted(tokens, tuple(blocks)))
    return out


def engine_tokens(arrival: Arrival, model: str) -> int:
    """The prompt's tokens as the emulator counts the body the load generator sends (filler
    included: its chat template's few tokens more than the arrival's own count)."""
    return _engine_reading(arrival, model)[0]


def _engine_reading(arrival: Arrival, model: str) -> tuple[int, list[int]]:
    """The body the load generator sends, as the emulator reads its prompt: its tokens and
    KV block hashes."""
    body = json.loads(chat_body(model, arrival))
    return prompt_blocks(body["messages"], chat=True)


def read(arrivals: Sequence[Arrival], model: str) -> list[Read]:
    """Per arrival, the body the load generator sends (filler text numbered by its place in
    the trace where it has no messages) read by the gateway: its length, the prefix index's
    blocks, the affinity key. Filler was routed on its lengths alone until 2026-12-07, while
    the live gateway hashed it like any prompt: a new prefix goes to its rendezvous node, and
    under ``[affinity]`` its head is a key."""
    keys = KeyMaker(AffinityConfig())
    out: list[Read] = []
    for i, arrival in enumerate(arrivals):
        raw = chat_body(model, arrival, i)
        body = json.loads(raw)
        # The load generator names the class in a header the benchmark's gateways trust.
        route = route_of(body, len(raw), prompt_class=arrival.prompt_class)
        out.append(Read(route, replace(route, session_key=keys(body))))
    return out


def prefix_load(
    nodes: Sequence[NodeSpec],
    arrivals: Sequence[Arrival],
    prepared: Sequence[Prompted | None],
    duration: float,
) -> dict[str, Any]:
    """KV demand and compute of the trace against the cluster (see the module docstring).

    A block counts toward KV demand from its first use to its last: held any shorter, its next
    use misses. Compute is each request's ttft + prefill + decode at the cluster's slot-weighted
    mean rates, over slots x duration."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    slots = sum(n.slots for n in nodes)
    ttft = sum(n.slots * n.ttft_ms / 1000 for n in nodes) / slots
    per_in = sum(n.slots / n.prefill_tokens_per_s for n in nodes if n.prefill_tokens_per_s) / slots
    per_out = sum(n.slots / n.tokens_per_s for n in nodes) / slots
    cold = warm = prompt = cached = 0.0
    for arrival, seen in zip(arrivals, prepared, strict=True):
        if seen is None:
            continue
        hit = 0
        for block in seen.blocks:
            if block not in first:
                break
            hit += 1
        for block in seen.blocks:
            first.setdefault(block, arrival.at)
            last[block] = arrival.at
        base = ttft + arrival.max_tokens * per_out
        cold += base + seen.tokens * per_in
        uncached = max(0, seen.tokens - hit * BLOCK_TOKENS)
        warm += base + uncached * per_in
        prompt += seen.tokens
        cached += seen.tokens - uncached
    reused = sum(last[b] - first[b] for b in first) / duration if duration > 0 else 0.0
    capacity = sum(kv_capacity(n) for n in nodes)
    work = slots * duration
    return {
        "kv_demand": reused / capacity if capacity else None,
        "kv_demand_blocks": round(reused, 1),
        "kv_capacity_blocks": capacity,
        "compute_no_cache": cold / work if work else None,
        "compute_ideal_cache": warm / work if work else None,
        "ideal_hit_rate": cached / prompt if prompt else None,
    }
