"""The emulator's counters and their vLLM-style Prometheus families, so that the sidecar and the
middleware read an emulated node exactly as they read a real vLLM engine."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from promptlb.shared import BLOCK_TOKENS

from ._capacity import Capacity
from ._config import EmulatorConfig
from ._kv import KVCache

__all__ = ["Stats", "VllmMetrics"]


@dataclass(slots=True)
class Stats:
    """What the node did: the counters its /metrics and /_emulator/stats expose."""

    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: int = 0
    errors: int = 0
    cancelled: int = 0  # generations abandoned because the client went away
    prefix_queries: int = 0  # generations that looked their prompt's prefix up ...
    prefix_hits: int = 0  # ... and found some of it cached
    prefix_query_tokens: int = 0  # the same in prompt tokens, as vLLM counts them
    prefix_hit_tokens: int = 0
    leaked: list[mmap.mmap] = field(default_factory=list)
    frees: int = 0  # `free_leaked`s so far: a leak begun before one is dropped when it ends

    def looked_up(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefix_queries += 1
        self.prefix_query_tokens += prompt_tokens
        if cached_tokens:
            self.prefix_hits += 1
            self.prefix_hit_tokens += cached_tokens

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "success": self.success,
            "errors": self.errors,
            "cancelled": self.cancelled,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_query_tokens": self.prefix_query_tokens,
            "prefix_cache_hit_tokens": self.prefix_hit_tokens,
        }


class VllmMetrics(Collector):
    """vLLM-style families, read from the live state at scrape time."""

    def __init__(
        self, config: EmulatorConfig, capacity: Capacity, kv: KVCache, stats: Stats
    ) -> None:
        self._config = config
        self._capacity = capacity
        self._kv = kv
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        config, cap, stats = self._config, self._capacity, self._stats
        model = config.models[0]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            cap.running,
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", cap.waiting
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(BLOCK_TOKENS), str(self._kv.capacity)], 1.0)
        yield info
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            self._kv.usage,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens,
        )
        yield counter(
            "vllm:request_success", "Count of successfully processed requests.", stats.success
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_query_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_hit_tokens,
        )
