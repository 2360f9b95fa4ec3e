"""Per-GPU load from NVML, through ``pynvml`` as shipped by nvidia-ml-py.

NVML is initialised once, when the collector opens, and shut down when it closes. A host without
a GPU, a driver or the library gives an empty list, logged once: the sidecar is as useful on a
CPU-only node, it just has less to say. `sample` blocks (NVML calls can take milliseconds): the
sidecar runs it in a worker thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from promptlb.shared import GpuSample

from ._live import Problem

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
    """Reads every GPU each sample; a GPU whose optional fields fail still reports the rest.

    Utilisation and memory are required: a GPU whose utilisation or memory query fails is left
    out of that sample. Each GPU's problem is logged once when it appears or changes, and once
    when the GPU reads again.
    """

    def __init__(self, nvml: Any = ..., *, enabled: bool = True) -> None:
        # nvml is injectable so that the mapping from NVML to GpuSample is testable without a GPU.
        self._nvml: Any = _import_nvml() if nvml is ... else nvml
        self._enabled = enabled
        self._handles: list[Any] = []
        self._open = False
        self._problems: dict[int, Problem] = {}
        # close() runs on the event loop while a sample may still run in its worker thread.
        self._lock = threading.Lock()
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
        with self._lock:
            if self._open:
                self._open = False
                self._handles = []
                try:
                    self._nvml.nvmlShutdown()
                except Exception as exc:
                    log.warning("NVML shutdown failed: %s", exc)

    def _problem(self, i: int) -> Problem:
        problem = self._problems.get(i)
        if problem is None:
            problem = self._problems[i] = Problem(log, f"GPU {i}")
        return problem

    def sample(self) -> tuple[GpuSample, ...]:
        with self._lock:
            return self._sample()

    def _sample(self) -> tuple[GpuSample, ...]:
        nvml = self._nvml
        out: list[GpuSample] = []
        for i, handle in enumerate(self._handles):
            problem = self._problem(i)
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except Exception as exc:
                # A GPU that fell off the bus: report it once per change, keep the others.
                problem.report(f"left out, utilisation unreadable: {exc}")
                continue
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:
                problem.report(f"left out, memory unreadable: {exc}")
                continue
            problem.clear()
            # Whole degrees and watts, as the wire format has them: ints pack in 1-3 bytes.
            temp: int | None
            power: int | None
            try:
                temp = int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            except Exception:  # no sensor on this board: optional, so not worth a warning
                temp = None
            try:
                power = round(nvml.nvmlDeviceGetPowerUsage(handle) / 1000)  # from milliwatts
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
