"""Configuration of what happens when models are slow, down or saturated: fallback chains, the
response cache and load shedding. Loaded by the same TOML converter as the rest (``_config``)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from promptlb.shared import ConfigError

from ._config_base import DURATION, check_model, check_redis_url, positive, redact_url

__all__ = ["CACHE_HOP", "CacheConfig", "FallbackConfig", "SheddingConfig"]

CACHE_HOP = "cache"  # the chain entry that means "a cached answer"


@dataclass(frozen=True, slots=True, kw_only=True)
class FallbackConfig:
    """``model``'s chain: when it misses ``ttft`` (to its first byte or token), exhausts its
    retries, or has no node, the hops of ``then`` are tried in order: lighter models (the
    request's ``model`` rewritten) and ``"cache"``. Every model hop gets the same deadlines.
    ``hedge_after``: with no first byte by then, a second attempt goes to another node (or the
    next model) and the first to answer wins."""

    model: str
    then: tuple[str, ...] = ()
    # None: no bound of its own (the headers within retry.per_try_timeout, the first byte
    # within the hop's total).
    ttft: float | None = field(default=None, metadata=DURATION)
    total: float | None = field(default=None, metadata=DURATION)  # None: retry.total_timeout
    hedge_after: float | None = field(default=None, metadata=DURATION)
    allow_opt_out: bool = True  # clients may send x-promptlb-no-fallback: 1

    def __post_init__(self) -> None:
        check_model("model", self.model)
        seen = {self.model}
        for i, hop in enumerate(self.then):
            check_model(f"then[{i}]", hop)
            if hop in seen:
                raise ConfigError(
                    f"then[{i}]", hop, "a model (or 'cache') not already in the chain"
                )
            seen.add(hop)
        for key in ("ttft", "total", "hedge_after"):
            value = getattr(self, key)
            if value is not None:
                positive(key, value)
        if self.ttft is not None and self.total is not None and self.total < self.ttft:
            raise ConfigError("total", self.total, f">= ttft ({self.ttft})")
        if self.hedge_after is not None and self.ttft is not None and self.hedge_after >= self.ttft:
            raise ConfigError("hedge_after", self.hedge_after, f"< ttft ({self.ttft})")

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(h for h in self.then if h != CACHE_HOP)


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """Complete, successful answers, kept for ``stale_ttl``, whatever their temperature. A
    ``cache`` hop (and a total outage) may serve any answer that old, to a sampled request too
    unless ``degraded_sampled`` is off (marked degraded: better than a 503); with ``serve_fresh``
    answers up to ``ttl`` old are served before routing at all, to deterministic requests only
    unless ``cache_sampled``. ``backend``: ``"memory"`` (per process, LRU bounded by
    ``max_bytes``) or a ``redis://`` URL shared by every replica."""

    backend: str = "memory"
    ttl: float = field(default=300.0, metadata=DURATION)
    stale_ttl: float = field(default=86400.0, metadata=DURATION)
    serve_fresh: bool = False
    on_outage: bool = True  # when every hop failed, a cached answer before a 503
    cache_sampled: bool = False  # serve_fresh answers requests with temperature > 0 too
    degraded_sampled: bool = True  # the cache hop and an outage answer sampled requests too
    default_temperature: float = 1.0  # what a request without `temperature` samples at
    families: Mapping[str, str] = field(default_factory=dict)  # model -> key shared by models
    max_bytes: int = 64 * 1024 * 1024
    max_entry_bytes: int = 1024 * 1024
    key_prefix: str = "promptlb:"
    timeout: float = field(default=0.05, metadata=DURATION)  # a slower lookup is a miss

    def __post_init__(self) -> None:
        if self.backend != "memory":
            check_redis_url("backend", self.backend, "'memory' or a redis://host:port/db URL")
        positive("ttl", self.ttl)
        positive("stale_ttl", self.stale_ttl)
        if self.stale_ttl < self.ttl:
            raise ConfigError("stale_ttl", self.stale_ttl, f">= ttl ({self.ttl})")
        positive("timeout", self.timeout)
        positive("default_temperature", self.default_temperature, zero=True)
        if self.max_bytes < 1024:
            raise ConfigError("max_bytes", self.max_bytes, ">= 1024")
        if not 1 <= self.max_entry_bytes <= self.max_bytes:
            raise ConfigError("max_entry_bytes", self.max_entry_bytes, "1..max_bytes")
        for model, family in self.families.items():
            if not isinstance(family, str) or not family:
                raise ConfigError(f"families.{model}", family, "a non-empty string")

    def __repr__(self) -> str:
        return (
            f"CacheConfig(backend={redact_url(self.backend)!r}, ttl={self.ttl}, "
            f"stale_ttl={self.stale_ttl}, serve_fresh={self.serve_fresh}, "
            f"max_bytes={self.max_bytes})"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SheddingConfig:
    """Admission by priority (``x-promptlb-priority: critical|standard|sheddable``). A model's
    pool is saturated when every candidate is over ``max_waiting`` (the engine's queue, per its
    snapshot plus what we sent since), ``max_kv`` (KV-cache use, 0..1) or ``max_in_flight``
    (our own open requests). Then sheddable requests get 429 at once, standard ones wait up to
    ``queue_timeout`` in a queue of ``queue_size`` (then, or at once when it is full, degrade or
    get 429), critical ones go
    through. Only clients from ``trusted_networks`` or with ``priority_token`` may raise their
    priority to critical; anyone may lower theirs."""

    enabled: bool = False
    max_waiting: int | None = 8
    max_kv: float | None = 0.95
    max_in_flight: int | None = None
    queue_size: int = 256
    queue_timeout: float = field(default=2.0, metadata=DURATION)
    retry_after: int = 1
    trusted_networks: tuple[str, ...] = ()
    priority_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        limits = (self.max_waiting, self.max_kv, self.max_in_flight)
        if self.enabled and all(limit is None for limit in limits):  # would never shed a thing
            raise ConfigError("enabled", True, "a limit too: max_waiting, max_kv or max_in_flight")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ConfigError("max_waiting", self.max_waiting, ">= 0")
        if self.max_kv is not None and not 0 < self.max_kv <= 1:
            raise ConfigError("max_kv", self.max_kv, "0 < max_kv <= 1")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ConfigError("max_in_flight", self.max_in_flight, ">= 1")
        if self.queue_size < 0:
            raise ConfigError("queue_size", self.queue_size, ">= 0")
        positive("queue_timeout", self.queue_timeout, zero=True)
        if self.retry_after < 1:
            raise ConfigError("retry_after", self.retry_after, "whole seconds >= 1")
        for i, net in enumerate(self.trusted_networks):
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ConfigError(
                    f"trusted_networks[{i}]", net, "an address or CIDR such as 10.0.0.0/8"
                ) from None
