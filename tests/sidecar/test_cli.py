from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from promptlb.sidecar import _cli
from promptlb.sidecar._cli import _read_model_key, _read_token, main


@pytest.fixture(autouse=True)
def never_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config that should have been refused fails the test, instead of serving for ever."""

    def serve(*args: Any) -> None:
        raise AssertionError("the sidecar was configured and would serve")

    monkeypatch.setattr(_cli, "serve", serve)


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
        (["--model-url", "http://127.0.0.1:abc"], "--model-url"),
        (["--model-url", "http://127.0.0.1:99999"], "--model-url"),
        (["--model-url", "http://[::1"], "--model-url"),
        (["--models", ",".join(f"m{i}" for i in range(65))], "--models"),
        (["--models", "m" * 257], "--models"),
        (["--tags", ",".join(f"t{i}" for i in range(65))], "--tags"),
        (["--token-file", "/nonexistent/token"], "--token-file"),
        (["--protect-reads"], "--protect-reads"),
        (["--warmup-max-tokens", "0"], "--warmup-max-tokens"),
        (["--model-pid", "0"], "--model-pid"),
        (["--rss-window", "0s"], "--rss-window"),
        # Never two samples in the window: no slope, so leaks went unseen in silence.
        (["--rss-window", "3s", "--sample-interval", "2s"], "--rss-window"),
        (["--node-name", "x" * 300], "--node-name"),
        (["--memory-limit-mb", "-5"], "--memory-limit-mb"),
        (["--unhealthy-after", "0"], "--unhealthy-after"),
        (["--memory-limit-mb", str(2**40)], "--memory-limit-mb"),
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


def test_a_short_token_file_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text("short\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--token-file", str(token)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --token-file" in err and "at least 8 characters" in err


def test_a_short_token_from_the_environment_names_the_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMPTLB_SIDECAR_TOKEN", "short")
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.splitlines()[-1]  # after the usage lines
    assert "PROMPTLB_SIDECAR_TOKEN" in message and "at least 8 characters" in message
    assert "--token-file" not in message and "short" not in message


def test_help_explains_every_value_and_shows_no_empty_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: ())" not in text
    assert "default: the host name" in text
    actions = {a.option_strings[-1]: a for a in _cli._parser()._actions if a.option_strings}
    for flag in ("--warmup-timeout", "--probe-timeout", "--warmup-max-tokens"):
        assert actions[flag].help and actions[flag].help != argparse.SUPPRESS, flag


def test_a_token_from_the_environment_is_stripped_as_one_from_a_file_is(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Secret made from a file keeps its newline; the token presented is stripped, so an
    # unstripped one never matched and every drain and warmup was a 401.
    parser = argparse.ArgumentParser()
    monkeypatch.setenv("PROMPTLB_SIDECAR_TOKEN", "a-long-enough-token\n")
    assert _read_token(parser, None) == "a-long-enough-token"
    monkeypatch.setenv("PROMPTLB_SIDECAR_TOKEN", " " * 12)
    with pytest.raises(SystemExit):
        _read_token(parser, None)
    assert "at least 8 characters" in capsys.readouterr().err


def test_the_model_servers_key_is_read_stripped_and_a_bad_one_named_not_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = argparse.ArgumentParser()
    key = tmp_path / "model-key"
    key.write_text("sk-abc123\n")  # a Secret made from a file keeps its newline
    assert _read_model_key(parser, key) == "sk-abc123"
    monkeypatch.setenv("PROMPTLB_MODEL_API_KEY", "sk-from-env\n")
    assert _read_model_key(parser, None) == "sk-from-env"
    monkeypatch.delenv("PROMPTLB_MODEL_API_KEY")
    assert _read_model_key(parser, None) is None
    key.write_text("sk-two\nlines-here\n")  # a header cannot hold it
    with pytest.raises(SystemExit) as exit_info:
        main(["--model-api-key-file", str(key)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --model-api-key-file" in err and "sk-two" not in err
    monkeypatch.setenv("PROMPTLB_MODEL_API_KEY", "sk\tsecret-part")
    with pytest.raises(SystemExit):
        _read_model_key(parser, None)
    err = capsys.readouterr().err
    assert "PROMPTLB_MODEL_API_KEY" in err and "secret-part" not in err


@pytest.mark.parametrize("given", ["info", "INFO"])
def test_the_log_level_is_taken_in_either_case(given: str) -> None:
    # As the gateway's: one LOG_LEVEL shared by a pod's containers crash-looped one of them.
    args = _cli._parser().parse_args(["--model-url", "http://127.0.0.1:1", "--log-level", given])
    assert args.log_level == "INFO"
