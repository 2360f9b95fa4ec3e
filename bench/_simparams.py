"""The simulator's inputs and outputs: the middleware's and client's knobs, and a run's outcome."""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from promptlb.middleware._strategies import STRATEGIES
from promptlb.shared import ConfigError

from ._scenario import Arrival, NodeSpec

__all__ = [
    "AFFINITY",
    "ORACLE",
    "PERFECT",
    "RANDOM",
    "SHARED",
    "SIM_STRATEGIES",
    "ServiceFn",
    "SimParams",
    "SimResult",
]

PERFECT = "perfect"
ORACLE = "oracle"
RANDOM = "random"
# A strategy under [affinity] at its defaults, as the gateway wraps it: "<strategy>+affinity".
AFFINITY = "+affinity"
# A strategy whose replicas share their prefix index as ``[index_share]`` does (every
# ``INDEX_SHARE_EVERY`` unless `SimParams.share_every` says otherwise): "<strategy>+shared".
SHARED = "+shared"
# Every name `simulate` accepts: the middleware's strategies, each with [affinity] and shared
# too, and the simulator's extras.
SIM_STRATEGIES = (
    *STRATEGIES,
    *(s + AFFINITY for s in STRATEGIES),
    *(s + SHARED for s in STRATEGIES),
    RANDOM,
    PERFECT,
    ORACLE,
)

# A replacement for the deterministic service time (seconds at slow factor 1), for tests that
# need a textbook distribution: called once per try, when the try reaches its node.
ServiceFn = Callable[[NodeSpec, Arrival, random.Random], float]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimParams:
    """The middleware's and the client's side of a run. Defaults are the middleware's config
    defaults, but for the health interval: 1 s, as the benchmark's gateways run (default 5 s)."""

    replicas: int = 8
    staleness: float = 1.0  # seconds between a replica's snapshot refreshes; 0: always fresh
    attempts: int = 3  # tries in all, the first included
    per_try_timeout: float = 30.0  # to the response headers (the first token, streaming)
    client_timeout: float = 60.0  # the load generator's per-request total timeout
    budget_percent: float = 20.0
    budget_min: int = 3
    health_interval: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 2
    outlier_failures: int = 5  # 0 disables ejection
    connect_fail_s: float = 0.005  # a refused connection to a dead process: a few ms
    slow_start: float = 30.0
    # Seconds between a replica's exchanges of its prefix index with the others (what the
    # gateway's `[index_share]` does through Redis); 0: every replica keeps its own, unless
    # the strategy's name ends in "+shared".
    share_every: float = 0.0
    seed: int = 1
    model: str = "bench"

    def __post_init__(self) -> None:
        for key in ("replicas", "attempts", "unhealthy_threshold", "healthy_threshold"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, value, "an integer >= 1")
        for key in ("budget_min", "outlier_failures"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(key, value, "an integer >= 0")
        for key in ("staleness", "slow_start", "connect_fail_s", "budget_percent", "share_every"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(key, value, "a number >= 0")
        for key in ("per_try_timeout", "client_timeout", "health_interval"):
            value = getattr(self, key)
            if not value > 0:  # inf is allowed: no timeout
                raise ConfigError(key, value, "a duration > 0")


@dataclass(slots=True, kw_only=True)
class SimResult:
    """What one run produced. Latencies and waits are of the requests that succeeded."""

    strategy: str
    requests: int
    latencies: array[float]  # seconds from arrival to the last token, retries included
    waits: array[float]  # seconds queued on the node that served the request
    ttfts: array[float]  # seconds from arrival to the first token, retries included
    errors: dict[str, int]  # by the last try's cause: crash, connect, timeout, reset, no_node
    retries: int  # tries after the first
    ejections: int
    node_names: list[str]
    dispatched: list[int]  # tries that reached each node (refused connections excluded)
    served: list[int]  # successful requests per node
    busy: list[float]  # slot-seconds of work per node within [0, duration]
    slots: list[int]
    max_depth: list[int]  # most requests on the node at once (running + queued)
    duration: float
    makespan: float  # virtual time of the last completion or failure
    wall_s: float
    events: int
    # Prompt tokens the nodes' KV caches were asked for and found, as the emulators count them
    # (0 and 0 when requests carry no prompt blocks).
    query_tokens: int = 0
    hit_tokens: int = 0
    # Successes that ended within [0, duration]: the live report's throughput counts those.
    in_window: int = 0
    # Per node, its KV cache's use (0..1) each second of the run, as vLLM's gauge reads it
    # (empty when requests carry no prompt blocks).
    kv_use: dict[str, list[float]] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return len(self.latencies)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())
