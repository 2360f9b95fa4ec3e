"""The sidecar that runs beside each model server: health, warmup, drain, load snapshots."""

from ._app import create_app
from ._config import EngineChoice, SidecarConfig
from ._engine import EngineMetricsError, EngineReading, parse_engine_metrics

__all__ = [
    "EngineChoice",
    "EngineMetricsError",
    "EngineReading",
    "SidecarConfig",
    "create_app",
    "parse_engine_metrics",
]
