"""Fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from promptlb.emulator._launch import Service, start_service

Launcher = Callable[..., Service]

__all__ = ["Launcher", "Service"]


@pytest.fixture
def launch() -> Iterator[Launcher]:
    """``launch("emulator", "--slots", "2")`` starts a real process; teardown stops them all."""
    started: list[Service] = []

    def _launch(module: str, *args: str, timeout: float = 20.0) -> Service:
        service = start_service(module, *args, timeout=timeout)
        started.append(service)
        return service

    yield _launch
    for service in reversed(started):
        service.stop()
