"""The live runner's side of prefix caching, for scenarios whose arrivals carry their prompt:

* ``X+affinity`` runs strategy X under ``[affinity]`` at its defaults (the 512-character prefix
  hash, bounded loads): today's affinity, measured beside the cache-aware default;
* ``X+shared`` runs strategy X on several gateway replicas sharing through ``[index_share]``
  and a Redis of their own, the load generator taking them in turn: the simulator's
  ``X+shared``, live;
* each run starts on empty caches (every emulator restarted on its port: a cache warmed by the
  previous router's run would flatter the next), and its hit rate is read from the emulators'
  own counters (``prefix_cache_query_tokens``/``hit_tokens`` of ``/_emulator/stats``), before
  and after, as vLLM's ``prefix_cache_queries``/``hits`` would give it;
* an ``X+shared`` run also reports how late its replicas learnt each other's records
  (``promptlb_index_share_lag_seconds`` of every replica, read at the end of the run).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from promptlb.middleware._strategies import DEFAULT_STRATEGY, STRATEGIES

from ._loadgen import UNREADABLE
from ._simparams import SHARED

__all__ = [
    "AFFINITY",
    "SHARED",
    "affinity_table",
    "cache_strategies",
    "hit_rate",
    "inner_strategy",
    "kv_counts",
    "restart_all",
    "share_lag",
    "share_table",
    "shares",
    "starts_cold",
    "watch_kv",
]

AFFINITY = "+affinity"


class _Restartable(Protocol):
    @property
    def urls(self) -> dict[str, str]: ...

    def restart(self, name: str) -> None: ...


def inner_strategy(name: str) -> str:
    """The strategy a run name configures: ``predictive+affinity`` is ``predictive``, and so is
    ``predictive+shared``."""
    return name.removesuffix(SHARED).removesuffix(AFFINITY)


def shares(name: str) -> bool:
    """Whether a run is of replicas sharing through ``[index_share]``."""
    return name.endswith(SHARED)


def share_table(redis_url: str | None) -> str:
    """The gateway TOML's ``[index_share]`` on ``redis_url``, or nothing."""
    return f"\n[index_share]\nredis = '{redis_url}'\n" if redis_url else ""


def known(name: str) -> bool:
    return inner_strategy(name) in STRATEGIES


def affinity_table(name: str) -> str:
    """The gateway TOML's ``[affinity]`` for a ``X+affinity`` run, else nothing."""
    return "\n[affinity]\n" if name.removesuffix(SHARED).endswith(AFFINITY) else ""


def cache_strategies(ours: Iterable[str]) -> list[str]:
    """The runs of a prompt-carrying scenario: the ones asked, today's affinity beside the
    default, which the report holds the default to, and the default on replicas that share."""
    out = list(ours)
    for wanted in (DEFAULT_STRATEGY + AFFINITY, DEFAULT_STRATEGY + SHARED):
        if wanted not in out:
            out.append(wanted)
    return out


KV_POLL_S = 1.0
# A node that does not answer, or answers something else, is left out of that reading.
_SHARE_LAG = "promptlb_index_share_lag_seconds"


async def watch_kv(
    http: aiohttp.ClientSession,
    urls: Mapping[str, str],
    clock: Callable[[], float],
    into: dict[str, list[list[float]]],
) -> None:
    """How full each node's KV cache is, cached blocks included (the emulator's ``kv_filled``:
    vLLM's own gauge counts a cached block no request holds as free), every `KV_POLL_S`, as
    ``[t, filled]`` on the run's clock: the report's per-node cache use over time."""
    while True:
        t = round(clock(), 2)
        for name, url in urls.items():
            with contextlib.suppress(*UNREADABLE):
                async with http.get(url + "/_emulator/stats") as response:
                    stats: dict[str, Any] = await response.json()
                into.setdefault(name, []).append([t, round(float(stats["kv_filled"]), 3)])
        await asyncio.sleep(KV_POLL_S)


async def kv_counts(
    http: aiohttp.ClientSession, urls: Mapping[str, str]
) -> dict[str, tuple[int, int]]:
    """Each emulator's prompt tokens looked up and found cached, by name; one that does not
    answer (or answers something else) is left out."""
    counts: dict[str, tuple[int, int]] = {}
    for name, url in urls.items():
        with contextlib.suppress(*UNREADABLE):
            async with http.get(url + "/_emulator/stats") as response:
                stats: dict[str, Any] = await response.json()
            counts[name] = (
                int(stats["prefix_cache_query_tokens"]),
                int(stats["prefix_cache_hit_tokens"]),
            )
    return counts


def hit_rate(
    before: Mapping[str, tuple[int, int]],
    after: Mapping[str, tuple[int, int]],
    nodes: Iterable[str],
) -> float | None:
    """Cached prompt tokens over prompt tokens between two readings, summed over the nodes;
    None unless every node answered both (a rate over the nodes that did passed for the
    cluster's). A node restarted by a fault in between restarts its counters: what it
    counted before its crash is lost, and its share is what its counters show since (summed
    as they were, one restart's fall cancelled another node's rise; a restarted node whose
    counters passed their old totals by the second reading is not seen as restarted)."""
    if not after or before.keys() != after.keys() or after.keys() != set(nodes):
        return None
    query = hit = 0
    for name, (q_after, h_after) in after.items():
        q_before, h_before = before[name]
        restarted = q_after < q_before or h_after < h_before
        query += q_after if restarted else q_after - q_before
        hit += h_after if restarted else h_after - h_before
    if query <= 0:
        return None
    return min(1.0, hit / query)


def starts_cold(prompted: bool, prefill_rates: Iterable[float]) -> bool:
    """Whether every run starts on emptied KV caches: where prompts carry prefixes, and
    wherever a node's prefill takes time (a cache then changes a request's time). Filler
    prompts are the same request for request in every run, so a run found the last one's tail
    still cached (mixed-class: all of it under a short ``--duration``)."""
    return prompted or any(rate > 0 for rate in prefill_rates)


def restart_all(cluster: _Restartable) -> None:
    """Every emulator again, side by side: empty KV caches, zeroed counters."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(cluster.restart, list(cluster.urls)))


async def share_lag(http: aiohttp.ClientSession, bases: Iterable[str]) -> dict[str, Any] | None:
    """How late the replicas at ``bases`` learnt each other's index entries, over the run:
    the entries learnt, and the share of them learnt within each of the histogram's bounds
    (summed over the replicas that answer); None when none does."""
    cumulative: dict[float, float] = {}
    for base in bases:
        with contextlib.suppress(*UNREADABLE):
            async with http.get(base + "/_promptlb/metrics") as response:
                text = await response.text()
            for family in text_string_to_metric_families(text):
                if family.name != _SHARE_LAG:
                    continue
                for sample in family.samples:
                    if sample.name.endswith("_bucket"):
                        bound = float(sample.labels["le"])
                        cumulative[bound] = cumulative.get(bound, 0.0) + sample.value
    entries = cumulative.get(math.inf, 0.0)
    if not entries:
        return None
    within = {
        f"{b:g}": round(n / entries, 4) for b, n in sorted(cumulative.items()) if b < math.inf
    }
    return {"entries": int(entries), "within_s": within}
