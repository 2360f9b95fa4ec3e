"""The promptlb ASGI middleware: route prompt requests to the node that can take them."""

from ._client import PromptLBClient, PromptLBError, Reply, ReplyStream
from ._config import (
    AffinityConfig,
    BatchingConfig,
    Config,
    DiscoveryConfig,
    HealthConfig,
    IndexShareConfig,
    NodeConfig,
    OutlierConfig,
    RequestsConfig,
    RetryConfig,
    load_config,
)
from ._config_degrade import CacheConfig, FallbackConfig, SheddingConfig
from ._middleware import PromptLBMiddleware
from ._refusals import NoNodeAvailable
from ._strategies import STRATEGIES
from ._view import NodeView, RouteRequest

__all__ = [
    "STRATEGIES",
    "AffinityConfig",
    "BatchingConfig",
    "CacheConfig",
    "Config",
    "DiscoveryConfig",
    "FallbackConfig",
    "HealthConfig",
    "IndexShareConfig",
    "NoNodeAvailable",
    "NodeConfig",
    "NodeView",
    "OutlierConfig",
    "PromptLBClient",
    "PromptLBError",
    "PromptLBMiddleware",
    "Reply",
    "ReplyStream",
    "RequestsConfig",
    "RetryConfig",
    "RouteRequest",
    "SheddingConfig",
    "load_config",
]
