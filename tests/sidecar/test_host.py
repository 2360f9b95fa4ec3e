"""Host CPU and memory from psutil, whichever thread samples."""

from __future__ import annotations

import threading
import time

from promptlb.sidecar._host import HostCollector


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_sample_taken_on_another_thread_measures_the_interval_since_the_last() -> None:
    # The sidecar samples on the event loop's worker threads, whichever is free: psutil's own
    # cpu_percent(interval=None) keeps its last reading per thread and gave a new one 0.0.
    host = HostCollector()
    spin(0.4)  # at least one core busy: half of two, a quarter of four
    found: list[float] = []
    worker = threading.Thread(target=lambda: found.append(host.sample()[0]))
    worker.start()
    worker.join()
    (cpu,) = found
    assert cpu > 0.0
    spin(0.4)
    again = host.sample()
    assert 0.0 < again[0] <= 1.0 and 0.0 < again[1] <= 1.0
