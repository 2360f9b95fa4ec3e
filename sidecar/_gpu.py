"""Per-GPU load from NVML, through ``pynvml`` as shipped by nvidia-ml-py.

NVML is initialised when the collector opens, and shut down when it closes. A host without
a GPU, a driver or the library gives an empty list, logged once: the sidecar is as useful on a
CPU-only node, it just has less to say. NVML that failed to start, or listed no GPU, is tried
again every `RETRY_S` from `sample`: a sidecar that started before the driver or the device
plugin was ready reported no GPU until it was restarted. `sample` blocks (NVML calls can take
milliseconds): the sidecar runs it in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from promptlb.shared import GpuSample

from ._live import Problem

__all__ = ["RETRY_S", "GpuCollector", "in_daemon_thread"]

_T = TypeVar("_T")

log = logging.getLogger("promptlb.sidecar.gpu")
_MiB = 1024 * 1024
_TEMP_C = (-100, 200)  # what a snapshot may carry (`shared._snapshot`)
_NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED, an NVMLError's `value`
_POWER_W = (0, 100_000)
RETRY_S = 30.0
CLOSE_WAIT_S = 2.0  # close waits this long for a sample under way


def _import_nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class GpuCollector:
    """Reads every GPU each sample; a GPU whose optional fields fail still reports the rest.

    Utilisation and memory are required: a GPU whose utilisation or memory query fails is left
    out of that sample, unless NVML says the card has no such reading ("not supported": a card
    in MIG mode has no utilisation of its own, reported as None; a unified-memory board no
    memory, reported as 0 of 0 MiB). Each GPU's problem is logged once when it appears or
    changes, and once when the GPU reads again.
    """

    def __init__(
        self,
        nvml: Any = ...,
        *,
        enabled: bool = True,
        devices: tuple[str, ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # nvml is injectable so that the mapping from NVML to GpuSample is testable without a GPU.
        self._nvml: Any = _import_nvml() if nvml is ... else nvml
        self._enabled = enabled
        # Which GPUs, by index or UUID (empty: every one NVML sees): several model servers on
        # one host each have a sidecar, and a sidecar reading all the host's GPUs reported
        # their average as its server's.
        self._devices = devices
        self._clock = clock
        self._handles: list[tuple[int, Any]] = []  # (NVML index, handle)
        self._unopened = 0  # cards the last listing could not open (or read the UUID of)
        self._cannot_open: set[int] = set()  # whose problem is that: cleared once they open
        self._open = False
        self._closed = False
        self._retry_at = 0.0
        self._failing_since: float | None = None  # since when every GPU fails, if it does
        self._problems: dict[int, Problem] = {}
        # close() runs on the event loop while a sample may still run in its worker thread.
        self._lock = threading.Lock()
        self.reason = ""  # why there are no GPUs, for /health and the logs

    def open(self) -> None:
        with self._lock:
            self._closed = False
            self._start()

    def _start(self) -> None:
        """Initialise NVML (unless it is) and list the GPUs; a reason, logged when it changes,
        for none. `sample` calls it again every `RETRY_S` while there is none."""
        nvml = self._nvml
        self._retry_at = self._clock() + RETRY_S
        before = self.reason
        if not self._enabled:
            self.reason = "GPU collection disabled"
            return
        if nvml is None:
            self._no_gpu("nvidia-ml-py is not installed", before)
            return
        if not self._open:
            try:
                nvml.nvmlInit()
            except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
                self._no_gpu(f"NVML unavailable: {exc}", before)
                return
            self._open = True
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as exc:
            self._handles = []
            self._no_gpu(f"NVML cannot list GPUs: {exc}", before, logging.WARNING)
            return
        devices = self._devices
        by_index = bool(devices) and all(d.isdigit() for d in devices)
        handles = []
        unopened = opened = 0
        for i in range(count):
            if by_index and str(i) not in devices:
                continue  # another server's: not even opened
            # Each on its own: one card off the bus (GPU_IS_LOST) or hidden by the cgroup
            # (NO_PERMISSION) failed the whole listing, and every other card went unreported.
            # Listed again every RETRY_S while one fails, so that a card back is found.
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:
                self._problem(i).report(f"left out, cannot be opened: {exc}")
                self._cannot_open.add(i)
                unopened += 1
                continue
            opened += 1
            if i in self._cannot_open:  # (another problem of its own: a sample clears that)
                self._cannot_open.discard(i)
                self._problem(i).clear()
            chosen = self._chosen(i, handle) if devices else True
            if chosen is None:
                unopened += 1  # its UUID unreadable: perhaps the one named
            elif chosen:
                handles.append((i, handle))
        self._handles = handles
        self._unopened = unopened
        if not handles:
            reason = "NVML reports no GPU"
            if unopened and not opened:
                reason = f"no GPU could be opened ({unopened} tried)"
            elif self._devices:
                reason = f"none of the GPUs {', '.join(self._devices)} among {count}"
                if unopened:  # (perhaps the one named: it cannot be told by its UUID)
                    reason += f" ({unopened} could not be opened or read)"
            self._no_gpu(reason, before, logging.WARNING if self._devices else logging.INFO)
            return
        self.reason = ""
        if before:
            log.info("GPU metrics: %d GPUs, after %s", len(self._handles), before)

    def _chosen(self, index: int, handle: Any) -> bool | None:
        """Whether the card is one of ``--gpu-devices``; None when its UUID is unreadable."""
        if str(index) in self._devices:
            return True
        if all(d.isdigit() for d in self._devices):
            return False  # by index alone: no NVML call for another server's GPU
        try:
            uuid = self._nvml.nvmlDeviceGetUUID(handle)
        except Exception:
            return None  # one lost GPU, perhaps another's, must not hide this server's
        return (uuid.decode() if isinstance(uuid, bytes) else str(uuid)) in self._devices

    def _no_gpu(self, reason: str, before: str, level: int = logging.INFO) -> None:
        self.reason = reason
        if reason != before:  # retried every RETRY_S: logged once per change
            log.log(level, "no GPU metrics: %s", reason)

    def close(self) -> None:
        if not self._lock.acquire(timeout=CLOSE_WAIT_S):
            # A sample hung in NVML holds the lock: shutting NVML down under it is no safer
            # than leaving it to the process's exit, which must not wait on it.
            log.warning("NVML hung in a sample: not shut down")
            return
        try:
            self._closed = True
            if self._open:
                self._shut_down()
        finally:
            self._lock.release()

    def _shut_down(self) -> None:
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
        if (
            (not self._handles or self._unopened)
            and not self._closed
            and self._clock() >= self._retry_at
        ):
            self._start()
        out: list[GpuSample] = []
        for i, handle in self._handles:
            problem = self._problem(i)
            util: float | None
            try:
                util = min(1.0, max(0.0, nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0))
            except Exception as exc:
                if getattr(exc, "value", None) != _NOT_SUPPORTED:
                    # A GPU that fell off the bus: report it once per change, keep the others.
                    problem.report(f"left out, utilisation unreadable: {exc}")
                    continue
                # A card in MIG mode has no utilisation of its own (NVML's documented "not
                # supported"): its memory still counts. Left out, every such card was, and
                # NVML restarted every RETRY_S for good.
                util = None
            used = total = 0
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                used, total = int(mem.used) // _MiB, int(mem.total) // _MiB
            except Exception as exc:
                if getattr(exc, "value", None) != _NOT_SUPPORTED:
                    problem.report(f"left out, memory unreadable: {exc}")
                    continue
                # A unified-memory board (GB10: nvidia-smi's "Memory-Usage: Not Supported")
                # has no memory of its own to read: 0 of 0. Left out, every such card was, and
                # NVML restarted every RETRY_S for good.
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
            # A glitched sensor (255 degrees, an all-ones milliwatt count) is no reading: out
            # of the wire format's range, it made every /snapshot of the node a 500.
            if temp is not None and not _TEMP_C[0] <= temp <= _TEMP_C[1]:
                temp = None
            if power is not None and not _POWER_W[0] <= power <= _POWER_W[1]:
                power = None
            out.append(GpuSample(i, util, used, total, temp, power))
        if self._handles and not out:
            self._all_failing()
        else:
            self._failing_since = None
        return tuple(out)

    def _all_failing(self) -> None:
        """Every GPU failed this sample: past `RETRY_S` of that, NVML is started again, its
        GPUs listed afresh (handles of a GPU that was lost and came back, or a driver reloaded,
        never read again until the sidecar restarted)."""
        now = self._clock()
        if self._failing_since is None:
            self._failing_since = now
            return
        if now - self._failing_since < RETRY_S:
            return
        self._failing_since = None
        self._shut_down()
        self._retry_at = now  # the next sample starts it again


def in_daemon_thread(call: Callable[[], _T]) -> asyncio.Future[_T]:
    """``call`` in a thread of its own that exit does not wait for (a hung NVML call must not
    hold the sidecar's shutdown; the default executor's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def run() -> None:
        try:
            result: Any = call()
            ok = True
        except Exception as exc:
            result, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, ok, result)

    threading.Thread(target=run, name="promptlb-sidecar-sample", daemon=True).start()
    return future
