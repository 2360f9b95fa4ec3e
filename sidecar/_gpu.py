"""Per-GPU load from NVML, through ``pynvml`` as shipped by nvidia-ml-py.

NVML is initialised once, when the collector opens, and shut down when it closes. A host without
a GPU, a driver or the library gives an empty list, logged once: the sidecar is as useful on a
CPU-only node, it just has less to say.
"""

from __future__ import annotations

import logging
from typing import Any

from promptlb.shared import GpuSample

__all__ = ["GpuCollector"]

log = logging.getLogger("promptlb.sidecar.gpu")
_MiB = 1024 * 1024


def _import_nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class GpuCollector:
    """Reads every GPU each sample; a GPU whose optional fields fail still reports the rest."""

    def __init__(self, nvml: Any = ..., *, enabled: bool = True) -> None:
        # nvml is injectable so that the mapping from NVML to GpuSample is testable without a GPU.
        self._nvml: Any = _import_nvml() if nvml is ... else nvml
        self._enabled = enabled
        self._handles: list[Any] = []
        self._open = False
        self.reason = ""  # why there are no GPUs, for /health and the logs

    def open(self) -> None:
        nvml = self._nvml
        if not self._enabled:
            self.reason = "GPU collection disabled"
            return
        if nvml is None:
            self.reason = "nvidia-ml-py is not installed"
            log.info("no GPU metrics: %s", self.reason)
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            self.reason = f"NVML unavailable: {exc}"
            log.info("no GPU metrics: %s", self.reason)
            return
        self._open = True
        try:
            count = nvml.nvmlDeviceGetCount()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:
            self.reason = f"NVML cannot list GPUs: {exc}"
            log.warning("no GPU metrics: %s", self.reason)
            self._handles = []
        if not self._handles and not self.reason:
            self.reason = "NVML reports no GPU"
            log.info("no GPU metrics: %s", self.reason)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._handles = []
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:
                log.warning("NVML shutdown failed: %s", exc)

    def sample(self) -> tuple[GpuSample, ...]:
        nvml = self._nvml
        out: list[GpuSample] = []
        for i, handle in enumerate(self._handles):
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:
                # A GPU that fell off the bus: report it once per change, keep the others.
                self._note(f"GPU {i}: {exc}")
                continue
            temp: float | None
            power: float | None
            try:
                temp = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            except Exception:
                temp = None
            try:
                power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
            except Exception:
                power = None
            out.append(
                GpuSample(
                    i,
                    min(1.0, max(0.0, util / 100.0)),
                    int(mem.used) // _MiB,
                    int(mem.total) // _MiB,
                    temp,
                    power,
                )
            )
        return tuple(out)

    def _note(self, problem: str) -> None:
        if problem != self.reason:
            self.reason = problem
            log.warning("GPU metrics incomplete: %s", problem)
