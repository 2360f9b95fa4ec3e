"""An emulated OpenAI-compatible model server, for tests, demos and benchmarks without GPUs."""

from ._app import create_app
from ._config import EmulatorConfig

__all__ = ["EmulatorConfig", "create_app"]
