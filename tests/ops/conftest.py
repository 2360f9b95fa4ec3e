"""Fixtures for the operations examples: Debian's binaries, a real Prometheus, the shipped files."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from promptlb.emulator import free_port

from tests.conftest import need_binary

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

__all__ = ["EXAMPLES", "ROOT", "Prometheus", "StartPrometheus", "load_yaml_documents"]


@pytest.fixture
def promtool() -> str:
    return need_binary("promtool", "prometheus")


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty document of a YAML file."""
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


class Prometheus:
    """Debian's ``prometheus`` on a random loopback port, with its data in ``workdir``."""

    def __init__(self, binary: str, workdir: Path, config: dict[str, Any]) -> None:
        self.workdir = workdir
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        for _ in range(3):  # a port taken between the probe and the bind: try another
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with self.log_path.open("wb") as log:
                self.proc = subprocess.Popen(
                    [
                        binary,
                        f"--config.file={config_path}",
                        f"--storage.tsdb.path={workdir / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--web.enable-lifecycle",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            if self._wait_ready():
                return
            self.stop()
        raise RuntimeError(f"prometheus did not start:\n{self.log()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s ``data``, asserting that the call succeeded."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: {exc.code} {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (a scalar comes back as one sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


StartPrometheus = Callable[[dict[str, Any]], Prometheus]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[StartPrometheus]:
    """``prometheus(config)`` starts a real Prometheus with that config (a dict); teardown
    stops it."""
    binary = need_binary("prometheus", "prometheus")
    started: list[Prometheus] = []

    def start(config: dict[str, Any]) -> Prometheus:
        workdir = tmp_path / f"prometheus-{len(started)}"
        workdir.mkdir()
        server = Prometheus(binary, workdir, config)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# A stand-in for pynvml (nvidia-ml-py), put first on a sidecar's PYTHONPATH: two GPUs, so that
# a real sidecar process exports its per-card series on a machine without one.
FAKE_PYNVML = """
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
_MiB = 1024 * 1024


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return 2


def nvmlDeviceGetHandleByIndex(i):
    return i


def nvmlDeviceGetUtilizationRates(h):
    return SimpleNamespace(gpu=[87, 35][h], memory=10)


def nvmlDeviceGetMemoryInfo(h):
    return SimpleNamespace(used=[70_000, 20_000][h] * _MiB, total=81_559 * _MiB)


def nvmlDeviceGetTemperature(h, sensor):
    return 60


def nvmlDeviceGetPowerUsage(h):
    return 300_000
"""


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes started after this (``launch``) import the two-GPU pynvml stand-in."""
    folder = tmp_path / "fake-nvml"
    folder.mkdir()
    (folder / "pynvml.py").write_text(FAKE_PYNVML)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{folder}{os.pathsep}{path}" if path else str(folder))
