"""The model engine's own load, read from its Prometheus ``/metrics``.

Only the few families that carry load are parsed: lines are filtered by exact metric name before
``prometheus_client.parser`` sees them. That keeps a 2,000-line vLLM scrape cheap, keeps
look-alikes out (vLLM V1's ``vllm:prompt_tokens_created``), and means that a malformed value in
an unrelated family (llama.cpp's ``-nan(ind)``) cannot spoil the whole reading.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from prometheus_client.parser import text_string_to_metric_families
from promptlb.shared._snapshot import MAX_COUNT, MAX_TPS

__all__ = [
    "ENGINES",
    "EngineMetricsError",
    "EngineName",
    "EngineReading",
    "TokenRate",
    "parse_engine_metrics",
]

EngineName = Literal["vllm", "tgi", "llamacpp", "sglang"]


@dataclass(frozen=True, slots=True)
class _Families:
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_cache: tuple[str, ...] = ()  # fraction 0..1 in every engine that has one
    tokens: tuple[str, ...] = ()  # a counter of generated tokens, for tokens/s
    # The counter grows by a request's whole answer when it ends, not per step: its rate over
    # one scrape interval is 0, then a burst (see `TokenRate`).
    tokens_at_end: bool = False
    tps: tuple[str, ...] = ()  # the engine's own gauge of generated tokens/s, preferred
    kv_tokens: tuple[str, ...] = ()  # a gauge of the KV cache's capacity in tokens
    # An info gauge whose labels give the capacity as num_gpu_blocks x block_size (vLLM).
    kv_info: tuple[str, ...] = ()


# The first name present wins, so newer names go first (vLLM renamed its KV gauge in V1).
ENGINES: Final[dict[EngineName, _Families]] = {
    "vllm": _Families(
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_cache=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        tokens=("vllm:generation_tokens",),
        kv_info=("vllm:cache_config_info",),
    ),
    "tgi": _Families(running=("tgi_batch_current_size",), waiting=("tgi_queue_size",)),
    "llamacpp": _Families(
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_cache=("llamacpp:kv_cache_usage_ratio",),
        tokens=("llamacpp:tokens_predicted",),
        tokens_at_end=True,  # metrics.on_prediction, when a slot's answer is done
    ),
    "sglang": _Families(
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_cache=("sglang:token_usage",),
        tokens=("sglang:generation_tokens",),
        tokens_at_end=True,  # observe_one_finished_request
        # The scheduler's decode throughput, over its last few dozen steps.
        tps=("sglang:gen_throughput",),
        kv_tokens=("sglang:max_total_num_tokens",),
    ),
}


def _text_names(families: _Families) -> set[str]:
    names = {*families.running, *families.waiting, *families.kv_cache, *families.kv_tokens}
    names.update(families.kv_info, families.tps, _counter_names(families.tokens))
    return names


def _counter_names(names: tuple[str, ...]) -> tuple[str, ...]:
    # A counter's samples are written with _total: after a TYPE line the parser names the
    # family without it, and without one (some exporters write none) with it.
    return tuple(n for t in names for n in (t, t + "_total"))


_WANTED: Final[dict[str, EngineName]] = {
    name: engine for engine, families in ENGINES.items() for name in _text_names(families)
}


class EngineMetricsError(ValueError):
    """The engine's /metrics could not be read as load."""


@dataclass(frozen=True, slots=True)
class EngineReading:
    engine: EngineName
    running: int
    waiting: int
    kv_cache: float | None
    tokens_total: float | None
    kv_tokens: int | None = None  # the KV cache's capacity in tokens, when the engine says
    tps: float | None = None  # generated tokens/s, when the engine measures it itself


def _name_of(line: str) -> str:
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    end = len(line)
    for stop in ("{", " ", "\t"):
        at = line.find(stop)
        if 0 <= at < end:
            end = at
    return line[:end]


def parse_engine_metrics(text: str, engine: EngineName | Literal["auto"] = "auto") -> EngineReading:
    """Running, waiting, KV use and generated tokens from a /metrics text.

    Several samples of one family (vLLM's ``engine`` label, SGLang's ranks, several models) are
    aggregated: running and waiting are summed, KV use takes the fullest cache.
    """
    kept: list[str] = []
    seen: set[EngineName] = set()
    # Lines end at "\n" alone, as prometheus-client reads them: str.splitlines() also splits
    # at U+2028, \x85 and others, which a label value may hold unescaped.
    for line in text.split("\n"):
        line = line.removesuffix("\r")
        name = _name_of(line)
        owner = _WANTED.get(name)
        if owner is not None and (engine == "auto" or owner == engine):
            kept.append(line)
            if not line.startswith("#"):
                seen.add(owner)
    if engine == "auto":
        if not seen:
            raise EngineMetricsError(
                "no load metrics of a known engine (vllm, tgi, llamacpp, sglang) found"
            )
        if len(seen) > 1:
            raise EngineMetricsError(
                f"metrics of several engines found: {sorted(seen)}; set --engine"
            )
        engine = seen.pop()
    # Per family, per label set less the ranks of one data-parallel group: SGLang's
    # schedulers of one group (tp_rank, pp_rank, moe_ep_rank; all of them with
    # --enable-metrics-for-all-schedulers) each write the same batch, which summed read a TP=4
    # node as four times as loaded. The group's largest stands for it.
    groups: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    fam = ENGINES[engine]
    try:
        for family in text_string_to_metric_families("\n".join(kept) + "\n"):
            info = family.name in fam.kv_info
            mine = groups.setdefault(family.name, {})
            for sample in family.samples:
                if info:
                    found = _blocks_times_size(sample.labels)
                    if found is None:
                        continue
                    value = found
                elif math.isnan(sample.value):  # "not measured yet": left out
                    continue
                else:
                    value = sample.value
                key = tuple(sorted(kv for kv in sample.labels.items() if not _in_group(kv[0])))
                before = mine.get(key)
                mine[key] = value if before is None else max(before, value)
    except ValueError as exc:
        raise EngineMetricsError(f"{engine} /metrics does not parse: {exc}") from None
    values = {name: list(got.values()) for name, got in groups.items() if got}
    return EngineReading(
        engine=engine,
        running=_count(values, fam.running, engine, "running"),
        waiting=_count(values, fam.waiting, engine, "waiting"),
        kv_cache=_fraction(_first(values, fam.kv_cache, max)),
        tokens_total=_finite(_first(values, _counter_names(fam.tokens), sum)),
        # vLLM's cache_config_info carries the engine's total: each data-parallel engine's
        # label repeats the sum of their blocks (summed again, DP ranks squared). SGLang's
        # data-parallel ranks each keep a cache of their own (and each measures its own
        # throughput): summed.
        kv_tokens=_capacity(_first(values, fam.kv_info, max) or _first(values, fam.kv_tokens, sum)),
        tps=_rate(_first(values, fam.tps, sum)),
    )


def _in_group(label: str) -> bool:
    """Whether ``label`` tells apart the schedulers of one data-parallel group, which write one
    batch: SGLang's ``tp_rank``, ``pp_rank``, ``moe_ep_rank`` (any rank but ``dp_rank``)."""
    return label.endswith("_rank") and label != "dp_rank"


def _blocks_times_size(labels: dict[str, str]) -> float | None:
    try:
        blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):  # "None" before the engine has profiled its memory
        return None
    return float(blocks * size) if blocks > 0 and size > 0 else None


def _capacity(value: float | None) -> int | None:
    # No cache, or a capacity no cache has: unknown, never a bound to trim an index to.
    if value is None or not 1 <= value <= MAX_COUNT:
        return None
    return int(value)


def _first(
    values: dict[str, list[float]], names: tuple[str, ...], fold: Callable[[list[float]], float]
) -> float | None:
    for name in names:
        got = values.get(name)
        if got:
            return float(fold(got))
    return None


def _fraction(value: float | None) -> float | None:
    # Engines round and race: a reading a hair over 1 (or under 0) is still "full" (or "empty").
    return None if value is None or math.isinf(value) else min(1.0, max(0.0, value))


def _rate(value: float | None) -> float | None:
    """Tokens/s a snapshot can carry: 0..1e9, else unknown."""
    return value if value is None or 0.0 <= value <= MAX_TPS else None


def _finite(value: float | None) -> float | None:
    # A counter at +Inf (or summed past a float's range) gives no rate: leave it out.
    return value if value is None or math.isfinite(value) else None


def _count(values: dict[str, list[float]], names: tuple[str, ...], engine: str, what: str) -> int:
    total = _first(values, names, sum)
    if total is None:
        raise EngineMetricsError(f"{engine} /metrics has no {what} gauge ({', '.join(names)})")
    # Beyond 2**53 a count is nonsense (and no longer exact as a float); the snapshot refuses it.
    if not 0 <= total <= MAX_COUNT:
        raise EngineMetricsError(f"{engine} /metrics reports {what} = {total:g}, outside 0..2**53")
    return round(total)


# A counter that moves when requests end is read over this long: at 4 concurrent requests of
# 1,000 tokens at 50 tokens/s each, its rate per 250 ms scrape was 0 in 19 of 20 readings and
# 4,000 in the others, and the gateways, skipping the zeros, took the node for 20x as fast.
END_COUNTER_WINDOW_S = 30.0


class TokenRate:
    """Generated tokens/s from successive readings of the engine's counter: over the last
    scrape interval, or, for a counter that grows when a request ends (``window_s`` > 0), over
    the last ``window_s`` seconds at least, and unknown until the readings span that long."""

    def __init__(self, window_s: float = 0.0) -> None:
        self.window_s = window_s
        self._readings: collections.deque[tuple[float, float]] = collections.deque()

    def reset(self) -> None:
        self._readings.clear()

    def update(self, now: float, total: float | None) -> float | None:
        readings = self._readings
        if total is None:
            readings.clear()
            return None
        if readings and (now <= readings[-1][0] or total < readings[-1][1]):
            readings.clear()  # a clock that did not move, or a counter reset with a restart
        readings.append((now, total))
        # Keep the newest reading at least the window old: the rate spans the window or more.
        while len(readings) > 2 and now - readings[1][0] >= self.window_s:
            readings.popleft()
        first_at, first = readings[0]
        if len(readings) < 2 or now - first_at < self.window_s:
            return None
        # A counter that leaps by more than 1e9 tokens/s is broken, not busy: unknown, not wrong.
        return _rate((total - first) / (now - first_at))
