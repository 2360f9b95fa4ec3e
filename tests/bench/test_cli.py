"""``promptlb-bench``'s own rules: where a run writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from promptlb.bench import _report
from promptlb.bench._cli import _parser, main


def test_a_run_as_committed_changes_no_setting() -> None:
    for argv in (["cluster", "rag"], ["sim", "rag", "--no-plot", "--out", "x"]):
        args = _parser().parse_args(argv)
        assert args.changed(args) == []
    args = _parser().parse_args(["cluster", "rag", "--peers", "oracle", "--replicas", "8"])
    assert args.changed(args) == ["peers"]  # the default value given is no change
    # Read as the run reads them: the scenario's own length and the same names in another
    # order are the committed run (they sent its results under quick/); a real change is not.
    same = ["cluster", "seed-3am", "--duration", "60s", "--peers", "litellm, nginx"]
    args = _parser().parse_args(same)
    assert args.changed(args) == []
    args = _parser().parse_args(["sim", "seed-3am", "--duration", "1m", "--staleness", "1.0s"])
    assert args.changed(args) == []
    args = _parser().parse_args(["sim", "seed-3am", "--duration", "30s", "--staleness", "2s"])
    assert args.changed(args) == ["staleness", "duration"]


def test_a_run_unlike_the_committed_ones_writes_under_quick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shorter run with one strategy, left to its default folder, would have replaced the
    committed sim-uniform-4.json (the cluster runner likewise its cluster-*.json)."""
    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    main(["sim", "uniform-4", "--duration", "1s", "--strategies", "p2c"])
    report = json.loads((tmp_path / "quick" / "sim-uniform-4.json").read_text())
    assert report["parameters"]["duration_s"] == 1.0
    assert "--strategies, --duration set" in capsys.readouterr().err
    assert not (tmp_path / "sim-uniform-4.json").exists()
