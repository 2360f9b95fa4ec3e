"""The fault suite at its short size: every fault applied under load to real processes, and
what the issue holds the gateway to for each."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
from promptlb.bench._faults import Cluster, until
from promptlb.bench._faultsuite import SOAK, run_faults, selected

from tests.conftest import need_binary


def test_the_quick_fault_suite_keeps_serving_through_every_fault(tmp_path: Path) -> None:
    need_binary("redis-server", "redis-server")
    report = run_faults(quick=True, out=tmp_path)
    assert (tmp_path / "faults.json").exists()
    rows = {row["fault"]: row for row in report["faults"]}
    # Ten faults and the soak, whose steady load beside the streams is a row of its own (it
    # went uncounted); each row says how long its fault was held (15 s when never seen).
    assert len(rows) == 11 and all(row["sent"] > 0 for row in rows.values())
    assert all(row["held_s"] >= 5.0 for row in rows.values())
    # Dead, frozen or leaking nodes are seen and come back; the load retries around them.
    for name in ("kill a node", "SIGSTOP a node", "a leaking node"):
        assert rows[name]["detect_s"] is not None, rows[name]
    for name, row in rows.items():
        if "streams" in name:
            assert row["failed"] == 0 and row["broken_streams"] == 0, row
            continue
        assert row["recover_s"] is not None, row
        # Nothing the gateway can route around fails a request; a node dying under a request
        # may cost one on this shared 2-core machine.
        assert row["failed"] <= (2 if name in ("kill a node", "SIGSTOP a node") else 0), row
    # The soak's memory is read twice while every stream is open (growth, not only the rise).
    assert len(report["soak_held_rss_mb"]) == 2 and report["soak_held_growth"] is not None


def test_a_partial_run_names_faults_by_parts_of_their_names_in_any_case() -> None:
    assert selected("a leaking node", None)  # no ``only``: everything
    assert selected("a leaking node", ["LEAK"])
    assert selected("kill a node", ["leak", "kill"])
    assert not selected("kill a node", ["leak"])
    assert selected(SOAK, ["Streams"]) and not selected(SOAK, ["leak"])  # the closing soak


async def test_a_check_that_cannot_be_read_does_not_hold_yet() -> None:
    # One status read timing out under a flood ended the whole fault suite, report and all.
    answers: list[object] = [aiohttp.ClientConnectionError("refused"), TimeoutError(), True]

    async def check() -> bool:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return bool(answer)

    took = await until(check, 5.0)
    assert took is not None and not answers
    assert await until(lambda: _never(), 0.12) is None


async def _never() -> bool:
    raise KeyError("nodes")


def test_a_node_started_again_lets_the_one_it_replaces_go(tmp_path: Path) -> None:
    # Each kill-and-start of the suite left the old process's log file and pipe behind.
    cluster = Cluster(tmp_path, "redis-server")
    cluster.start_model("a")
    first = cluster.models["a"]
    first.kill()
    try:
        cluster.start_model("a")
        assert not os.path.exists(first.log_path) and first.proc.stdout is not None
        assert first.proc.stdout.closed
    finally:
        cluster.models["a"].stop()
