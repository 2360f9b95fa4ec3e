"""Fixtures that run the real emulator (``python -m promptlb.emulator``) on 127.0.0.1.

Processes start through `promptlb.emulator.start_service` (``--port 0``, then the
``listening on`` line) and every one is stopped at teardown.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest
from promptlb.emulator import Service, start_service

from tests.conftest import Launcher

Emulator = Service
StartEmulator = Callable[..., Service]


@pytest.fixture
def emulator_argv() -> list[str]:
    """The emulator's command line without flags (for tests that run it to completion)."""
    return [sys.executable, "-m", "promptlb.emulator"]


@pytest.fixture
def start_emulator(launch: Launcher) -> StartEmulator:
    """``start_emulator("--slots", "2", ...)`` starts one more emulator; all stop at teardown."""

    def start(*flags: str) -> Service:
        return launch("emulator", "--host", "127.0.0.1", *flags)

    return start


# The flags of the emulator that the plain endpoint tests share (one process per module):
# fast (10 ms TTFT, 1000 tokens/s, an SSE event every 5 ms: 5 tokens an event), three model names
# given both ways (repeated flag and comma list), and a non-default embedding size.
SHARED_FLAGS = (
    *("--model", "emulated", "--model", "alt,third"),
    *("--ttft-ms", "10", "--tokens-per-s", "1000", "--stream-interval-ms", "5"),
    *("--embedding-dim", "8", "--seed", "1"),
)


@pytest.fixture(scope="module")
def shared_emulator() -> Iterator[Service]:
    emu = start_service("emulator", *SHARED_FLAGS)
    try:
        yield emu
    finally:
        emu.stop()
