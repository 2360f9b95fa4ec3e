from __future__ import annotations

from pathlib import Path

import pytest
from promptlb.sidecar._cli import main


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--port", "70000"], "--port"),
        (["--port", "many"], "--port"),
        (["--sample-interval", "soon"], "--sample-interval"),
        (["--sample-interval", "1ms"], "--sample-interval"),
        (["--probe-timeout", "-1s"], "--probe-timeout"),
        (["--engine", "triton"], "--engine"),
        (["--model-url", "ftp://example"], "--model-url"),
        (["--model-url", "not a url"], "--model-url"),
        (["--token-file", "/nonexistent/token"], "--token-file"),
        (["--protect-reads"], "--protect-reads"),
        (["--warmup-max-tokens", "0"], "--warmup-max-tokens"),
        (["--model-pid", "0"], "--model-pid"),
        (["--rss-window", "0s"], "--rss-window"),
        (["--node-name", "x" * 300], "--node-name"),
    ],
)
def test_invalid_values_exit_2_naming_the_flag(
    args: list[str], flag: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROMPTLB_SIDECAR_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_bad_key_and_token_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = tmp_path / "key"
    short.write_text("k1:short\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--sign-key-file", str(short)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--sign-key-file" in err and "at least 16 bytes" in err
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(SystemExit):
        main(["--token-file", str(empty)])
    assert "--token-file" in capsys.readouterr().err
