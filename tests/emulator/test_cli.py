"""``promptlb-emulator`` on the command line: bad values exit 2 naming the flag; shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import time
from typing import TYPE_CHECKING

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from promptlb.emulator._cli import _parser, main

if TYPE_CHECKING:
    from tests.emulator.conftest import StartEmulator

RUN_TIMEOUT_S = 30


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--slots", "0"], "--slots"),
        (["--error-rate", "2"], "--error-rate"),
        (["--port", "70000"], "--port"),
        (["--tokens-per-s", "-1"], "--tokens-per-s"),
    ],
)
def test_invalid_values_exit_2_naming_the_flag(
    emulator_argv: list[str], flags: list[str], flag: str
) -> None:
    cmd = [*emulator_argv, "--host", "127.0.0.1", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 2, done.stderr
    assert f"argument {flag}:" in done.stderr
    assert "listening" not in done.stdout


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--slots", "-3"], "--slots"),
        (["--error-rate", "-0.1"], "--error-rate"),
        (["--error-rate", "nan"], "--error-rate"),
        (["--port", "-1"], "--port"),
        (["--tokens-per-s", "0"], "--tokens-per-s"),
        (["--tokens-per-s", "inf"], "--tokens-per-s"),
        (["--slow-factor", "0"], "--slow-factor"),
        (["--slow-factor", "1e-320"], "--slow-factor"),
        (["--ttft-ms", "-5"], "--ttft-ms"),
        (["--max-queue", "-1"], "--max-queue"),
        (["--embedding-dim", "0"], "--embedding-dim"),
        (["--hang-after", "-1"], "--hang-after"),
        (["--crash-after", "-1"], "--crash-after"),
        (["--leak-mb-per-req", "-1"], "--leak-mb-per-req"),
        (["--load-time-s", "-1"], "--load-time-s"),
        (["--stream-interval-ms", "0"], "--stream-interval-ms"),
        (["--kv-blocks", "-1"], "--kv-blocks"),
        (["--prefill-tokens-per-s", "-1"], "--prefill-tokens-per-s"),
        (["--output-spread", "1e200"], "--output-spread"),  # every request without max_tokens 500
        (["--model", ""], "--model"),
        (["--model", ","], "--model"),
        (["--slots", "two"], "--slots"),  # argparse's own type check
    ],
)
def test_more_invalid_values_in_process(
    flags: list[str], flag: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # main() configures logging before it validates: keep it off this process's root logger.
    monkeypatch.setattr(logging, "basicConfig", lambda **_: None)
    with pytest.raises(SystemExit) as info:
        main(["--host", "127.0.0.1", *flags])
    assert info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_help_exits_0(emulator_argv: list[str]) -> None:
    cmd = [*emulator_argv, "--help"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0
    for flag in ("--slots", "--error-rate", "--hang-after", "--crash-after", "--leak-mb-per-req"):
        assert flag in done.stdout


def test_port_in_use_exits_1_with_a_message(emulator_argv: list[str]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [*emulator_argv, "--host", "127.0.0.1", "--port", str(port)]
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
        )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly(start_emulator: StartEmulator, sig: signal.Signals) -> None:
    emu = start_emulator()
    assert emu.url.startswith("http://127.0.0.1:")
    assert 0 < emu.port < 65536
    emu.proc.send_signal(sig)
    assert emu.proc.wait(RUN_TIMEOUT_S) == 0


async def test_sigterm_with_a_request_in_flight_exits_promptly(
    start_emulator: StartEmulator,
) -> None:
    """A request that will not finish soon (a long TTFT here; --hang-after behaves the same) must
    not keep a SIGTERMed emulator alive: the process has already stopped listening, and a harness
    that terminates it and waits should not wait minutes."""
    bound_s = 12.0
    emu = start_emulator("--ttft-ms", "600000")
    chat = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 1}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        in_flight = asyncio.create_task(session.post(f"{emu.url}/v1/chat/completions", json=chat))
        deadline = time.monotonic() + 10
        running = 0.0
        while time.monotonic() < deadline and running != 1:
            async with session.get(f"{emu.url}/metrics") as resp:
                families = text_string_to_metric_families(await resp.text())
                running = next(
                    s.value
                    for f in families
                    for s in f.samples
                    if s.name == "vllm:num_requests_running"
                )
            await asyncio.sleep(0.02)
        assert running == 1
        # The client keeps waiting (its connection stays open) while the emulator is terminated.
        emu.proc.terminate()
        try:
            returncode = await asyncio.to_thread(emu.proc.wait, bound_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            in_flight.cancel()
            await asyncio.gather(in_flight, return_exceptions=True)
    assert returncode is not None, (
        f"still running {bound_s:.0f} s after SIGTERM with one request in flight"
    )
    assert returncode == 0


@pytest.mark.parametrize("given", ["warning", "WARNING"])
def test_the_log_level_is_taken_in_either_case(given: str) -> None:
    assert _parser().parse_args(["--log-level", given]).log_level == "WARNING"
