"""The middleware's configuration: typed, keyword-only objects, loaded from TOML or built in code.

Every object validates itself; the TOML loader converts by the field types and names the full
key (``nodes[1].url``) in every error, with the value and what was expected.
"""
# Over 350 lines: the config dataclasses, one concern: many small typed tables, each validating
# its own keys.

from __future__ import annotations

import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from promptlb.shared import ConfigError, Redacted, SigningKey, load_keys, parse_duration

from ._classify import CLASSES
from ._config_base import (
    DURATION,
    check_header_name,
    check_model,
    check_redis_url,
    check_url,
    positive,
    whole_number,
)
from ._config_degrade import CACHE_HOP, CacheConfig, FallbackConfig, SheddingConfig
from ._strategies import DEFAULT_STRATEGY, STRATEGIES

__all__ = [
    "GOSSIP_JITTER",
    "AffinityConfig",
    "BatchingConfig",
    "CacheConfig",
    "Config",
    "DiscoveryConfig",
    "FallbackConfig",
    "HealthConfig",
    "IndexShareConfig",
    "NodeConfig",
    "OutlierConfig",
    "RequestsConfig",
    "RetryConfig",
    "SheddingConfig",
    "load_config",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """One model node: its OpenAI-compatible server and, optionally, its sidecar."""

    name: str
    url: str
    sidecar: str | None = None
    weight: float = 1.0
    models: tuple[str, ...] = ()  # empty: learnt from the sidecar's snapshot
    tags: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None  # read the upstream key from this environment variable

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 253:
            raise ConfigError("name", self.name, "1..253 characters")
        if not self.name.isprintable():
            # It is sent in the x-promptlb-node header: the server refused a control character
            # there, and every answer of a healthy node failed, charged to it.
            raise ConfigError("name", self.name, "printable text")
        object.__setattr__(self, "url", check_url("url", self.url))
        for i, model in enumerate(self.models):
            check_model(f"models[{i}]", model)
        if self.sidecar is not None:
            object.__setattr__(self, "sidecar", check_url("sidecar", self.sidecar))
        # A ratio between nodes: near 1e308, weighted round robin's running sums became NaN.
        positive("weight", self.weight, most=1e6)
        if (
            self.api_key_env is not None
            and self.api_key is not None
            # A copy, read from it before (its ends stripped as then).
            and self.api_key != (os.environ.get(self.api_key_env) or "").strip()
        ):
            # One of them was silently ignored (the environment's).
            raise ConfigError("api_key_env", self.api_key_env, "no api_key beside it")
        if self.api_key_env is not None and self.api_key is None:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ConfigError("api_key_env", self.api_key_env, "a set environment variable")
            object.__setattr__(self, "api_key", _one_line(key, "api_key_env", self.api_key_env))
        elif self.api_key is not None:
            object.__setattr__(self, "api_key", _one_line(self.api_key, "api_key", None))


def _one_line(secret: str, key: str, source: str | None) -> str:
    """A secret sent in a header, its ends stripped (a Kubernetes Secret made from a file ends
    in a newline); one with a control character inside is refused, unprinted: aiohttp refused
    it on every try, which failed outright, not retried elsewhere nor charged to the node."""
    clean = secret.strip()
    if not clean or not clean.isprintable():
        raise ConfigError(key, source or Redacted(secret), "one line of printable text")
    return clean


@dataclass(frozen=True, slots=True, kw_only=True)
class AffinityConfig:
    """Session and prefix affinity, on top of the configured strategy (see ``_affinity``).

    ``key``: what keys a request. ``session``: the ``header`` (if set) or the body's ``user``;
    ``prefix``: a hash of the prompt's first ``prefix_chars`` characters, for prompts at least
    that long; ``both``: the session when there is one, else the prefix. A keyed request goes
    to its node on a hash ring of ``vnodes`` points per node, unless that node's load is over
    ``1 + epsilon`` times the average: then to the next node on the ring."""

    key: Literal["session", "prefix", "both"] = "both"
    header: str | None = None  # e.g. "x-session-id"; wins over the body's user
    prefix_chars: int = 512
    epsilon: float = 0.25
    vnodes: int = 64

    def __post_init__(self) -> None:
        if self.key not in ("session", "prefix", "both"):
            raise ConfigError("key", self.key, "one of 'session', 'prefix', 'both'")
        if self.header is not None:
            check_header_name("header", self.header)
        for key, low, high in (("prefix_chars", 1, 1 << 20), ("vnodes", 1, 4096)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(key, value, f"an integer in {low}..{high}")
        # Past it the bound is no bound (101 times the average), and a huge one overflowed
        # the bound's arithmetic into an error on every keyed pick.
        positive("epsilon", self.epsilon, most=100.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryConfig:
    """``static``: the ``[[nodes]]`` list. ``dns``: A/AAAA records of ``name`` (a headless
    service), each address one node at ``port``, with its sidecar at ``sidecar_port``.
    ``scheme`` is the model servers'; ``sidecar_scheme`` the sidecars' (which serve plain
    HTTP themselves: https only behind a proxy that terminates it)."""

    mode: Literal["static", "dns"] = "static"
    name: str = ""
    port: int = 8000
    sidecar_port: int | None = 9500  # 0 (TOML has no null) or None: the nodes have none
    scheme: Literal["http", "https"] = "http"
    sidecar_scheme: Literal["http", "https"] = "http"
    interval: float = field(default=30.0, metadata=DURATION)
    # Each lookup's bound: a DNS server that stops answering held up startup and every reload
    # (and the shutdown behind a reload) for as long as the resolver's own retries took.
    timeout: float = field(default=5.0, metadata=DURATION)
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode == "dns" and not self.name:
            raise ConfigError("name", self.name, "a DNS name to resolve (discovery mode dns)")
        for i, model in enumerate(self.models):
            check_model(f"models[{i}]", model)
        if self.mode == "dns":
            try:
                # As the resolver takes it: an empty label (gw..svc) or one over 63 characters
                # raised UnicodeError out of the lookup, which stopped the gateway's start
                # (naming no key) or left a reload with no gossip or health loops at all.
                self.name.encode("idna")
            except UnicodeError:
                raise ConfigError("name", self.name, "a DNS name, its labels 1-63 long") from None
        if self.sidecar_port == 0 and not isinstance(self.sidecar_port, bool):
            # Discovered nodes without sidecars: each health check went to a sidecar port with
            # nothing there, and each gossip round failed.
            object.__setattr__(self, "sidecar_port", None)
        for key in ("port", "sidecar_port"):
            port = getattr(self, key)
            if port is not None and not 1 <= port <= 65535:
                raise ConfigError(key, port, "a TCP port in 1..65535")
        positive("interval", self.interval)
        positive("timeout", self.timeout)


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthConfig:
    """Active health checks with Envoy's semantics. ``expected_statuses`` are half-open
    ranges ``[start, end)``."""

    enabled: bool = True
    path: str = "/health"
    interval: float = field(default=5.0, metadata=DURATION)
    timeout: float = field(default=1.0, metadata=DURATION)
    interval_jitter: float = field(default=0.5, metadata=DURATION)
    unhealthy_threshold: int = 2
    healthy_threshold: int = 2
    expected_statuses: tuple[tuple[int, int], ...] = ((200, 300),)
    use_sidecar: bool = True  # check the sidecar's /health (warmup, drain) when there is one

    def __post_init__(self) -> None:
        if not self.path.startswith("/"):
            raise ConfigError("path", self.path, "a path starting with /")
        positive("interval", self.interval)
        positive("timeout", self.timeout)
        positive("interval_jitter", self.interval_jitter, zero=True)
        for key in ("unhealthy_threshold", "healthy_threshold"):
            if getattr(self, key) < 1:
                raise ConfigError(key, getattr(self, key), "an integer >= 1")
        if not self.expected_statuses:  # no status would pass: every node unhealthy, every 503
            raise ConfigError("expected_statuses", [], "at least one [start, end) range")
        for i, pair in enumerate(self.expected_statuses):
            if len(pair) != 2 or not 100 <= pair[0] < pair[1] <= 600:
                raise ConfigError(
                    f"expected_statuses[{i}]", pair, "[start, end) with 100 <= start < end <= 600"
                )

    def expected(self, status: int) -> bool:
        return any(lo <= status < hi for lo, hi in self.expected_statuses)


@dataclass(frozen=True, slots=True, kw_only=True)
class OutlierConfig:
    """Passive ejection, as Envoy's outlier detection: ``consecutive_failures`` in a row eject a
    node for ``base_ejection_time x times ejected`` (up to ``max_ejection_time``; each
    ``base_ejection_time`` back without an ejection takes a step off), never more than
    ``max_ejection_percent`` of a model's nodes at once, but always one (Envoy's rule)."""

    consecutive_failures: int = 5
    base_ejection_time: float = field(default=30.0, metadata=DURATION)
    max_ejection_time: float = field(default=300.0, metadata=DURATION)
    max_ejection_percent: float = 50.0
    # A non-streamed try that times out is the request's doing, not the node's, when its
    # max_tokens needs longer than the try was given at the node's decode rate: the rate its
    # sidecar last showed per running request, or this one when it has shown none.
    assumed_tokens_per_s: float = 20.0
    # A node whose sidecar projects its model server out of memory (RSS growing, at its slope,
    # into the memory left) within this long is drained: no new requests, in-flight ones
    # finish, until a snapshot projects no OOM (a clean restart). 0 disables.
    drain_before_oom: float = field(default=300.0, metadata=DURATION)

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ConfigError("consecutive_failures", self.consecutive_failures, ">= 1")
        positive("base_ejection_time", self.base_ejection_time)
        positive("max_ejection_time", self.max_ejection_time)
        if not 0 <= self.max_ejection_percent <= 100:
            raise ConfigError("max_ejection_percent", self.max_ejection_percent, "0..100")
        positive("assumed_tokens_per_s", self.assumed_tokens_per_s)
        positive("drain_before_oom", self.drain_before_oom, zero=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryConfig:
    """Retries on another node, before the first byte reaches the client only."""

    attempts: int = 3  # tries in all, the first included
    per_try_timeout: float = field(default=30.0, metadata=DURATION)  # to the response headers
    total_timeout: float = field(default=120.0, metadata=DURATION)  # the whole answer
    connect_timeout: float = field(default=2.0, metadata=DURATION)
    budget_percent: float = 20.0  # retries in flight, as a share of active requests ...
    min_concurrent: int = 3  # ... but always at least this many

    def __post_init__(self) -> None:
        if not 1 <= self.attempts <= 10:
            raise ConfigError("attempts", self.attempts, "1..10")
        for key in ("per_try_timeout", "total_timeout", "connect_timeout"):
            positive(key, getattr(self, key))
        if not 0 <= self.budget_percent <= 100:
            raise ConfigError("budget_percent", self.budget_percent, "0..100")
        if self.min_concurrent < 0:
            raise ConfigError("min_concurrent", self.min_concurrent, ">= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestsConfig:
    """What a request must be before any node sees it (a 400 otherwise), and how long its
    client may take to send it. What a node would fail on anyway is refused here, so that a
    bad request costs no node a failure (see design.md, "What counts as a node fault")."""

    max_tokens: int = 10_000_000  # above any context window: a larger value is not a length
    context: Mapping[str, int] = field(default_factory=dict)  # model -> its context, in tokens
    max_json_depth: int = 64  # tool schemas nest a dozen levels; a thousand is an attack
    body_timeout: float = field(default=10.0, metadata=DURATION)  # the whole body, once begun

    def __post_init__(self) -> None:
        whole_number("max_tokens", self.max_tokens, 1)
        whole_number("max_json_depth", self.max_json_depth, 2)
        for model, tokens in self.context.items():
            whole_number(f"context.{model}", tokens, 1)
        positive("body_timeout", self.body_timeout)

    def token_limit(self, model: str) -> int:
        """The largest ``max_tokens`` a request for ``model`` may ask."""
        context = self.context.get(model)
        return self.max_tokens if context is None else min(context, self.max_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchingConfig:
    """Embedding micro-batching: ``/embeddings`` requests that could share one upstream call
    (same model, same other fields) and arrive within ``batch_window`` of the first are sent as
    one request of at most ``max_batch`` inputs, and the answer is split back per caller."""

    enabled: bool = False
    batch_window: float = field(default=0.002, metadata=DURATION)
    max_batch: int = 64

    def __post_init__(self) -> None:
        positive("batch_window", self.batch_window)
        # Every batched caller waits up to the window: longer than a second is a misconfiguration.
        if self.batch_window > 1.0:
            raise ConfigError("batch_window", self.batch_window, "at most 1s")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int):
            raise ConfigError("max_batch", self.max_batch, "an integer >= 2")
        if self.max_batch < 2:
            raise ConfigError("max_batch", self.max_batch, "an integer >= 2 (1 batches nothing)")


# Seconds; the simulator's "+shared" runs exchange as often. The others' load since a node's
# snapshot is known to within this, and what a replica does not know yet it herds onto: in the
# simulator (1 s old snapshots, 8 replicas) 20 ms instead of 100 took shared-system-prompt's
# TTFT p90 from 0.52 to 0.43 s (oracle 0.43; 40 seeds), multi-tenant-chat's from 1.31 s / hit
# 0.60 to 1.22 s / 0.64 (oracle 1.05 / 0.64; 24 seeds), at 50 replicas from 1.89 s / 0.43 to
# 1.54 s / 0.49; 10 and 5 ms did no better. A round is one Redis round trip (write and read
# pipelined): about 100 us of the gateway's CPU idle, 15 us more per entry of another replica
# read (hiredis), so at 8 busy replicas about 1% of a core.
INDEX_SHARE_EVERY = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexShareConfig:
    """Gateway replicas share what the cache-aware strategy records (which prompt prefixes
    went to which node) through a Redis stream, so that each routes by every replica's traffic
    and counts the others' requests since a node's last snapshot. Every ``every`` a replica
    writes what it sent since and reads what the others wrote. Redis down costs hit rate, never
    a request: the exchange is skipped until it answers again."""

    redis: str = field(repr=False)  # redis://host:port/db, rediss:// or unix://
    every: float = field(default=INDEX_SHARE_EVERY, metadata=DURATION)
    key: str = "promptlb:prefixes"  # one stream per deployment: the replicas that share
    # The stream is trimmed to about this many batches: at 20 ms, 4 s of 50 busy replicas' rounds
    # (a replica stalled longer skips what was trimmed; it catches up 4,096 entries a round).
    max_entries: int = 10_000
    timeout: float = field(default=0.2, metadata=DURATION)  # each Redis call

    def __post_init__(self) -> None:
        check_redis_url("redis", self.redis, "a redis://host:port/db URL")
        if not 0.01 <= self.every <= 60:
            raise ConfigError("every", self.every, "a duration in 10ms..60s")
        if not self.key:
            raise ConfigError("key", self.key, "a non-empty Redis key")
        if self.max_entries < 100:
            raise ConfigError("max_entries", self.max_entries, ">= 100")
        positive("timeout", self.timeout)


GOSSIP_JITTER = 0.1  # a gossip round starts up to this share of gossip_interval late


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Everything the middleware needs; every key but ``nodes`` (or dns discovery) optional."""

    nodes: tuple[NodeConfig, ...] = ()
    strategy: str = DEFAULT_STRATEGY  # a name in the registry, STRATEGIES
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    routes: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
    models_route: str | None = "/v1/models"  # aggregated from the ready nodes
    max_body_bytes: int = 4 * 1024 * 1024
    forward_authorization: bool = False
    # Headers besides api-key, x-api-key and OpenAI's organisation and project that name the
    # caller to the nodes (an API gateway's subscription key): answers and merged batches are
    # shared only among requests that send the same values.
    caller_headers: tuple[str, ...] = ()
    # The client's X-Forwarded-For / Forwarded / X-Real-IP reach the nodes only when set: they
    # are the client's claims, and a node that logs or trusts them would be told lies.
    forward_client_address: bool = False
    gossip_interval: float = field(default=1.0, metadata=DURATION)
    gossip_timeout: float = field(default=0.5, metadata=DURATION)
    gossip_concurrency: int = 32
    stale_after: float = field(default=5.0, metadata=DURATION)
    sign_key_file: str | None = None  # "KID:SECRET": unsigned or badly signed snapshots rejected
    sidecar_token_file: str | None = None  # bearer token for sidecars with --protect-reads
    slow_start: float = field(default=30.0, metadata=DURATION)  # 0 disables
    admin_token: str | None = field(default=None, repr=False)
    admin_token_file: str | None = None  # the admin token from a file (a mounted Secret)
    admin_local_only: bool = False
    admin_prefix: str = "/_promptlb"
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    requests: RequestsConfig = field(default_factory=RequestsConfig)
    fallback: tuple[FallbackConfig, ...] = ()
    cache: CacheConfig | None = None  # no response cache unless configured
    shedding: SheddingConfig = field(default_factory=SheddingConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)  # off unless enabled
    classifier: str | None = None  # "package.module:callable"; None: the rules-based default
    class_header: str | None = None  # a trusted header (set by your edge) that names the class
    affinity: AffinityConfig | None = None  # no session/prefix affinity unless configured
    index_share: IndexShareConfig | None = None  # replicas keep their own index unless set

    def __post_init__(self) -> None:
        for i, name in enumerate(self.caller_headers):
            check_header_name(f"caller_headers[{i}]", name)
        if self.class_header is not None:
            # One no request can carry (spaces, empty) was silently the built-in classifier.
            check_header_name("class_header", self.class_header)
        route = self.models_route
        if route is not None and (not isinstance(route, str) or not route.startswith("/")):
            # "v1/models" matched nothing; "" answered the mount's root with the model list.
            raise ConfigError("models_route", self.models_route, "a path starting with /")
        if self.strategy not in STRATEGIES:
            raise ConfigError("strategy", self.strategy, "one of " + ", ".join(sorted(STRATEGIES)))
        routes = self.strategy_options.get("routes")
        builtin = self.classifier is None and self.class_header is None
        if self.strategy == "model_aware" and isinstance(routes, Mapping) and builtin:
            # The classes are the built-in ones unless a classifier or a header names others:
            # a mistyped class (cdoe) was a route no request ever took.
            for name in routes:
                if name not in CLASSES:
                    raise ConfigError(
                        f"strategy_options.routes.{name}",
                        name,
                        "one of " + ", ".join(CLASSES) + " (or set classifier/class_header)",
                    )
        if self.discovery.mode == "dns" and self.nodes:
            # They served until the first answer replaced them, and no reload ever touched
            # them: neither a bootstrap list nor a part of the cluster.
            raise ConfigError("nodes", [n.name for n in self.nodes], "none with discovery dns")
        if self.discovery.mode == "static" and not self.nodes:
            raise ConfigError("nodes", [], "at least one [[nodes]] entry (or discovery dns)")
        seen: set[str] = set()
        for i, node in enumerate(self.nodes):
            if node.name in seen:
                raise ConfigError(f"nodes[{i}].name", node.name, "a name no other node has")
            seen.add(node.name)
        for i, route in enumerate(self.routes):
            if not route.startswith("/"):
                raise ConfigError(f"routes[{i}]", route, "a path starting with /")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes", self.max_body_bytes, ">= 1024")
        positive("gossip_interval", self.gossip_interval)
        positive("gossip_timeout", self.gossip_timeout)
        positive("stale_after", self.stale_after)
        if self.stale_after > 86_400:  # the replay check's bound: a ValueError out of start
            raise ConfigError("stale_after", self.stale_after, "at most a day (86400s)")
        # A snapshot is renewed once a round at best, and rounds start up to a jittered
        # interval apart and take up to gossip_timeout: two can land that far apart from a
        # healthy sidecar. One that goes stale sooner is missing for part of some rounds, and a
        # draining or warming node flaps to ready meanwhile.
        renewed = self.gossip_interval * (1 + GOSSIP_JITTER) + self.gossip_timeout
        if self.stale_after <= renewed:
            raise ConfigError(
                "stale_after",
                self.stale_after,
                f"> gossip_interval x {1 + GOSSIP_JITTER:g} + gossip_timeout ({renewed:g}s)",
            )
        positive("slow_start", self.slow_start, zero=True)
        if self.gossip_concurrency < 1:
            raise ConfigError("gossip_concurrency", self.gossip_concurrency, ">= 1")
        if self.admin_token is not None and self.admin_token_file is not None:
            raise ConfigError("admin_token_file", self.admin_token_file, "no admin_token beside it")
        if self.admin_token is not None and not (
            self.admin_token.isascii() and self.admin_token.isprintable() and self.admin_token
        ):
            # Empty (an unset variable substituted into the file), every admin route answered
            # 403 "need admin_token" with no error at start; not ASCII, no browser sends it.
            raise ConfigError("admin_token", Redacted(self.admin_token), "printable ASCII text")
        prefix = self.admin_prefix
        # Visible ASCII: the dashboard's redirect writes it into a Location header (a CJK
        # prefix raised UnicodeEncodeError there, a 500; an accented one sent a latin-1 byte).
        if (
            not prefix.startswith("/")
            or prefix.endswith("/")
            or not all(33 <= ord(c) < 127 and c not in "?#" for c in prefix)
        ):
            raise ConfigError("admin_prefix", prefix, "a path like /_promptlb, in ASCII")
        chained: set[str] = set()
        for i, chain in enumerate(self.fallback):
            if chain.model in chained:
                raise ConfigError(f"fallback[{i}].model", chain.model, "one chain per model")
            chained.add(chain.model)
            if CACHE_HOP in chain.then and self.cache is None:
                raise ConfigError(f"fallback[{i}].then", list(chain.then), "a [cache] table")
            # A hedge due after the hop's whole time never goes (it was taken, and did nothing).
            total = chain.total if chain.total is not None else self.retry.total_timeout
            if chain.hedge_after is not None and chain.hedge_after >= total:
                whose = "total" if chain.total is not None else "retry.total_timeout"
                raise ConfigError(
                    f"fallback[{i}].hedge_after", chain.hedge_after, f"< {whose} ({total:g})"
                )

    def sign_keys(self) -> tuple[SigningKey, ...]:
        """The keys snapshots may be signed with, one a line of ``sign_key_file`` (several
        while they rotate); none when it is not set."""
        if self.sign_key_file is None:
            return ()
        try:
            return load_keys(self.sign_key_file)
        except ValueError as exc:
            raise ConfigError("sign_key_file", self.sign_key_file, str(exc)) from None

    def sidecar_token(self) -> str | None:
        return _read_token("sidecar_token_file", self.sidecar_token_file)

    def admin_secret(self) -> str | None:
        """``admin_token``, or the contents of ``admin_token_file``."""
        if self.admin_token is not None or self.admin_token_file is None:
            return self.admin_token
        token = _read_token("admin_token_file", self.admin_token_file)
        if token is None or not token.isascii():
            # Empty (a Secret mounted before it was filled), every admin route answered 403
            # with no error at start; not ASCII, no browser sends it.
            raise ConfigError(
                "admin_token_file", self.admin_token_file, "a file holding printable ASCII text"
            )
        return token


def _read_token(key: str, path: str | None) -> str | None:
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(key, path, f"a readable file ({exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(key, path, "a UTF-8 text file holding the token") from None
    if not token.isprintable():
        # Sent as a header: aiohttp refused two lines (old and new token, mid-rotation) on
        # every poll and check, and every node stayed "unknown" for good.
        raise ConfigError(key, path, "a file holding one token on one line")
    return token or None


T = TypeVar("T")


def load_config(source: str | Path | Mapping[str, Any] | Config) -> Config:
    """A `Config` from a TOML path, a mapping of the same shape, or a `Config` (as is)."""
    if isinstance(source, Config):
        return source
    if isinstance(source, str | Path):
        try:
            with open(source, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError("config", str(source), f"a readable TOML file ({exc})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", str(source), f"valid TOML ({exc})") from None
        except UnicodeDecodeError as exc:  # not a TOMLDecodeError: TOML is UTF-8
            raise ConfigError("config", str(source), f"UTF-8 TOML ({exc.reason})") from None
        return build(Config, data, "")
    return build(Config, source, "")


# Fields whose value an error must not print.
_SECRETS = frozenset({"api_key", "admin_token", "priority_token"})


def build(cls: type[T], data: object, path: str) -> T:
    """Convert a mapping into the dataclass ``cls`` by its field types; errors carry the path."""
    if not isinstance(data, Mapping):
        raise ConfigError(path or "config", data, "a table")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in known:
            # A mistyped key may be a secret's (admin_tokne = "..."): its value is not echoed.
            raise ConfigError(where, Redacted(value), "one of " + ", ".join(sorted(known)))
        if key == "strategy_options":
            if not isinstance(value, Mapping):
                raise ConfigError(where, value, "a table")
            kwargs[key] = dict(value)
            continue
        try:
            kwargs[key] = _convert(
                hints[key], value, where, known[key].metadata.get("duration", False)
            )
        except ConfigError as exc:
            if key in _SECRETS:
                raise ConfigError(exc.key, Redacted(value), exc.expected) from None
            raise
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        where = f"{path}.{exc.key}" if path else exc.key
        shown = Redacted(exc.value) if exc.key in _SECRETS else exc.value
        raise ConfigError(where, shown, exc.expected) from None
    except TypeError as exc:  # a required field is missing
        missing = [
            f.name
            for f in fields(cls)  # type: ignore[arg-type]
            if f.default is MISSING and f.default_factory is MISSING and f.name not in kwargs
        ]
        if missing:
            where = f"{path}.{missing[0]}" if path else missing[0]
            raise ConfigError(where, None, "a value (it is required)") from None
        raise ConfigError(path or "config", data, str(exc)) from None


def _convert(hint: Any, value: object, where: str, duration: bool) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where, duration)
    if duration:
        return parse_duration(where, value)
    if origin is Literal:
        if value not in args:
            raise ConfigError(where, value, "one of " + ", ".join(repr(a) for a in args))
        return value
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(where, value, "a table")
        return {str(k): _convert(args[1], v, f"{where}.{k}", False) for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(where, value, "a list")
        item = args[0]
        return tuple(_convert(item, v, f"{where}[{i}]", False) for i, v in enumerate(value))
    if is_dataclass(hint):
        return build(hint, value, where)  # type: ignore[arg-type]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(where, value, "true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(where, value, "an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(where, value, "a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(where, value, "a string")
        return value
    raise ConfigError(where, value, f"a value of type {hint}")  # pragma: no cover
