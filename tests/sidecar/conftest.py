"""Stand-ins shared by the sidecar tests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

__all__ = ["FakeNvml"]

_MiB = 1024 * 1024


class NVMLError(Exception):
    def __init__(self, message: str, value: int = 999) -> None:  # (pynvml's codes: `value`)
        super().__init__(message)
        self.value = value


class FakeNvml:
    """Two GPUs; the second has no power sensor, as many boards do."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, *, init_fails: bool = False) -> None:
        self.init_fails = init_fails
        self.inits = 0
        self.shutdowns = 0
        self.broken: set[int] = set()  # utilisation queries fail
        self.broken_memory: set[int] = set()
        self.mig: set[int] = set()  # in MIG mode: no utilisation of the whole card
        self.unified: set[int] = set()  # unified memory (GB10): no memory reading
        self.lost: set[int] = set()  # off the bus: not even a handle

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_fails:
            raise NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i in self.lost:
            raise NVMLError("GPU is lost", 15)
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}1c2d3e4-0000-0000-0000-00000000000{h}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        if h in self.broken:
            raise NVMLError("GPU is lost")
        if h in self.mig:
            raise NVMLError("Not Supported", 3)
        return SimpleNamespace(gpu=[87, 3][h], memory=10)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        if h in self.broken_memory:
            raise NVMLError("Unknown Error")
        if h in self.unified:
            raise NVMLError("Not Supported", 3)
        return SimpleNamespace(used=[70_000, 1_000][h] * _MiB, total=81_559 * _MiB)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return [71, 40][h]

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if h == 1:
            raise NVMLError("Not Supported")
        return 312_600  # milliwatts


@pytest.fixture
def nvml() -> FakeNvml:
    """A fresh stand-in for pynvml: two GPUs, nothing broken, not yet initialised."""
    return FakeNvml()
