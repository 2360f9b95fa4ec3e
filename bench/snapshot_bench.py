"""Snapshot cost: encode+decode+verify of an 8-GPU node, and a real sidecar's /snapshot rate.

Prints the numbers, PASS or MISS against each goal, and writes bench/results/snapshot.json.
Goals (issue 2): <= 20 us and <= 512 bytes per signed 8-GPU snapshot. The GPUs come from the
sidecar's own `GpuCollector` over a stand-in for NVML, so the benchmark encodes the values the
sidecar really sends. Run: `make bench` or `python bench/snapshot_bench.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
import timeit
from types import SimpleNamespace
from typing import Any

import aiohttp
from promptlb.bench._report import RESULTS, environment
from promptlb.emulator import Service, start_service
from promptlb.shared import (
    EPOCHS_V,
    EngineSample,
    GpuSample,
    SigningKey,
    Snapshot,
    decode,
    encode,
)
from promptlb.sidecar._gpu import GpuCollector

_MiB = 1024 * 1024


class EightGpuNvml:
    """Enough of pynvml for `GpuCollector`: eight busy 80 GB boards, as on an H100 node."""

    NVML_TEMPERATURE_GPU = 0

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 8

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=87 - h, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(used=(70_312 + h) * _MiB, total=81_559 * _MiB)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 71 + h % 3

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 312_456 + 1_234 * h  # milliwatts


def eight_gpus() -> tuple[GpuSample, ...]:
    collector = GpuCollector(EightGpuNvml())
    collector.open()
    try:
        gpus = collector.sample()
    finally:
        collector.close()
    assert len(gpus) == 8, collector.reason
    return gpus


def eight_gpu_snapshot() -> Snapshot:
    return Snapshot(
        node="gpu-node-07.cluster.local",
        boot="9f2c4e1a7b3d5e60",
        seq=123_456,
        v=EPOCHS_V,  # as the sidecar writes it: no byte more than v1
        ts=time.time(),
        ready=True,
        warm=True,
        models=("llama-3.1-70b-instruct",),
        tags=("code", "chat"),
        tier="heavy",
        cpu=0.4375,
        mem=0.6211,
        gpus=eight_gpus(),
        # A reading from the collector's last tick, as the sidecar stamps it.
        engine=EngineSample(running=24, waiting=7, kv_cache=0.8125, tps=1843.5, age_ms=180),
        rss=38_654_705_664,
        rss_slope=1024.0,
    )


def codec(repeat: int, number: int) -> dict[str, Any]:
    snapshot = eight_gpu_snapshot()
    key = SigningKey("k1", b"a-shared-secret-of-32-bytes-long")
    keys = {key.kid: key}
    signed = encode(snapshot, key)
    assert decode(signed, keys).gpus == snapshot.gpus

    def per_call_us(fn: Any) -> float:
        runs = timeit.repeat(fn, repeat=repeat, number=number)
        return min(runs) / number * 1e6  # the least disturbed run: what the code costs

    round_trip = per_call_us(lambda: decode(encode(snapshot, key), keys))
    return {
        "gpu_sample": list(snapshot.gpus[0]),
        "bytes_signed": len(signed),
        "bytes_unsigned": len(encode(snapshot)),
        "encode_sign_us": per_call_us(lambda: encode(snapshot, key)),
        "decode_verify_us": per_call_us(lambda: decode(signed, keys)),
        "round_trip_us": round_trip,
        "goal_us": 20.0,
        "goal_bytes": 512,
    }


async def snapshot_rate(seconds: float, concurrency: int, limit: int) -> dict[str, Any]:
    """Hammer a real sidecar's /snapshot from this process, bounded in count and time."""
    model = start_service("emulator", "--ttft-ms", "5")
    sidecar: Service | None = None
    latencies: list[float] = []
    try:
        # Inside the try: a sidecar that fails to start must not leave the emulator running.
        sidecar = start_service(
            "sidecar", "--model-url", model.url, "--no-warmup-required", "--log-level", "WARNING"
        )
        url = sidecar.url + "/snapshot"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
            await asyncio.sleep(0.5)  # let the collectors take a first sample
            deadline = time.perf_counter() + seconds

            async def worker() -> None:
                while time.perf_counter() < deadline and len(latencies) < limit:
                    start = time.perf_counter()
                    async with http.get(url) as response:
                        decode(await response.read())
                    latencies.append(time.perf_counter() - start)

            began = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            elapsed = time.perf_counter() - began
    finally:
        if sidecar is not None:
            sidecar.stop()
        model.stop()
    latencies.sort()
    return {
        "requests": len(latencies),
        "seconds": elapsed,
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1e3,
        "concurrency": concurrency,
        "note": "client and sidecar share this machine's cores; the client is Python too",
    }


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of the /snapshot run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a short run, for smoke tests")
    args = parser.parse_args()
    repeat, number = (3, 2_000) if args.quick else (7, 20_000)
    seconds = 1.0 if args.quick else args.seconds
    report: dict[str, Any] = {
        "benchmark": "snapshot",
        **environment(),  # commit, dirty, when, python, cores: what was measured, where
        "machine": platform.machine(),
        "codec_8_gpus": codec(repeat, number),
        "sidecar_snapshot": asyncio.run(snapshot_rate(seconds, args.concurrency, 200_000)),
    }
    c, s = report["codec_8_gpus"], report["sidecar_snapshot"]
    c["bytes_ok"] = c["bytes_signed"] <= c["goal_bytes"]
    c["round_trip_ok"] = c["round_trip_us"] <= c["goal_us"]
    print(
        f"8-GPU snapshot: {c['bytes_signed']} bytes signed ({c['bytes_unsigned']} unsigned), "
        f"goal <= {c['goal_bytes']}: {_verdict(c['bytes_ok'])}"
    )
    print(
        f"  encode+sign {c['encode_sign_us']:.1f} us, decode+verify {c['decode_verify_us']:.1f}"
        f" us, round trip {c['round_trip_us']:.1f} us, goal <= {c['goal_us']:.0f} us:"
        f" {_verdict(c['round_trip_ok'])}"
    )
    print(
        f"sidecar /snapshot: {s['requests_per_s']:.0f} req/s over {s['requests']} requests "
        f"(p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, {s['concurrency']} concurrent)"
    )
    # A quick run goes under quick/, as every other bench's: it overwrote the committed file.
    out = RESULTS / "quick" / "snapshot.json" if args.quick else RESULTS / "snapshot.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
