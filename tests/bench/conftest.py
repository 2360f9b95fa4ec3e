"""Shared helpers for the bench's tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from promptlb.bench._live import Cluster
from promptlb.bench._scenario import load_scenario


@contextmanager
def running_cluster(path: Path, scenario: str) -> Iterator[Cluster]:
    """The live cluster of the scenario TOML ``scenario`` (written to ``path``), started;
    every process it started is stopped on the way out."""
    path.write_text(scenario, encoding="utf-8")
    cluster = Cluster(load_scenario(str(path)))
    try:
        cluster.start()  # (in here: what a start that fails half-way began is stopped too)
        yield cluster
    finally:
        cluster.stop()
