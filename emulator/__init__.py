"""An emulated OpenAI-compatible model server, for tests, demos and benchmarks without GPUs."""

from ._app import create_app
from ._config import EmulatorConfig
from ._launch import Service, free_port, start_command, start_redis, start_service

__all__ = [
    "EmulatorConfig",
    "Service",
    "create_app",
    "free_port",
    "start_command",
    "start_redis",
    "start_service",
]
