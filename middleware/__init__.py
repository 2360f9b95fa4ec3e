"""The promptlb ASGI middleware: route prompt requests to the node that can take them."""

from ._client import PromptLBClient, PromptLBError
from ._config import (
    Config,
    DiscoveryConfig,
    HealthConfig,
    NodeConfig,
    OutlierConfig,
    RequestsConfig,
    RetryConfig,
    load_config,
)
from ._middleware import PromptLBMiddleware
from ._refusals import NoNodeAvailable
from ._strategies import STRATEGIES
from ._view import NodeView, RouteRequest

__all__ = [
    "STRATEGIES",
    "Config",
    "DiscoveryConfig",
    "HealthConfig",
    "NoNodeAvailable",
    "NodeConfig",
    "NodeView",
    "OutlierConfig",
    "PromptLBClient",
    "PromptLBError",
    "PromptLBMiddleware",
    "RequestsConfig",
    "RetryConfig",
    "RouteRequest",
    "load_config",
]
