"""The faults a running emulator can be given (``POST /_emulator/faults``): their state, the
check of an update (all or nothing) and its application."""

from __future__ import annotations

import asyncio
import json
import math
import mmap
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_LEAK_MB", "MAX_SLOW", "MIN_SLOW", "Faults", "check_faults", "holds", "leak"]

_MiB = 1024 * 1024
# A request's leak at most: a gigabyte a request (1e9 was taken) failed every request after
# on a mapping the system refused.
MAX_LEAK_MB = 1024
# A slow factor's range: 1e-320 made the decode rate infinite, and every request a 500.
MIN_SLOW, MAX_SLOW = 1e-3, 1e6


@dataclass(slots=True)
class Faults:
    """The faults that can change while the process runs (``POST /_emulator/faults``); the CLI
    flags are only their starting values. A benchmark plays a scenario's faults over time with
    them, without restarting the process (which would reset its queue and its leaked memory)."""

    slow_factor: float = 1.0
    leak_mb_per_req: float = 0.0
    error_rate: float = 0.0
    # A request whose body holds this text is answered 500, on every node alike: a request
    # that breaks the model server (a tokenizer crash), not a broken node. "" is off.
    poison: str = ""
    # Set while the node is hung: requests wait on it, then go on once the hang is lifted, as
    # the work queued on a stalled server does when it recovers.
    running: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.running.set()

    @property
    def hang(self) -> bool:
        return not self.running.is_set()

    def as_dict(self) -> dict[str, Any]:
        return {
            "slow_factor": self.slow_factor,
            "hang": self.hang,
            "leak_mb_per_req": self.leak_mb_per_req,
            "error_rate": self.error_rate,
            "poison": self.poison,
        }

    def update(self, body: dict[str, Any]) -> None:
        """Apply a faults update that `check_faults` passed (``free_leaked`` is the stats')."""
        if "slow_factor" in body:
            self.slow_factor = float(body["slow_factor"])
        if "leak_mb_per_req" in body:
            self.leak_mb_per_req = float(body["leak_mb_per_req"])
        if "error_rate" in body:
            self.error_rate = float(body["error_rate"])
        if "poison" in body:
            self.poison = body["poison"]
        if "hang" in body:
            if body["hang"]:
                self.running.clear()
            else:
                self.running.set()


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)  # an integer past a float's range: OverflowError
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def leak(mb: float) -> mmap.mmap | None:
    """A request's leak of ``mb`` MiB, every page written (real RSS); None when the system has
    no memory left for it. Mapped pages of its own: a freed heap buffer raised glibc's mmap
    threshold, and after the first ``free_leaked`` later leaks came from the heap and freeing
    them gave no RSS back. Called in a thread: a page at a time in Python lets the GIL go
    between pages (one slice assignment held it through every page fault: the event loop
    stalled 1.2 s for a 1 GB leak)."""
    # A page at least: a leak under one byte mapped 0 bytes, which mmap refuses, and every
    # request answered 500.
    size = max(mmap.PAGESIZE, int(mb * _MiB))
    try:
        mapped = mmap.mmap(-1, size)
    except OSError:
        return None
    for offset in range(0, size, mmap.PAGESIZE):
        mapped[offset] = 1
    return mapped


def check_faults(body: dict[str, Any]) -> str | None:
    """What is wrong with a faults update, or None."""
    known = ("slow_factor", "hang", "leak_mb_per_req", "error_rate", "poison", "free_leaked")
    for key in body:
        if key not in known:
            return f"unknown key `{key}`; expected some of {', '.join(known)}"
    for key in ("hang", "free_leaked"):
        if key in body and not isinstance(body[key], bool):
            return f"`{key}` must be true or false"
    if "slow_factor" in body:
        value = _number(body["slow_factor"])
        if value is None or not MIN_SLOW <= value <= MAX_SLOW:
            return f"`slow_factor` must be a number in {MIN_SLOW:g}..{MAX_SLOW:g}"
    if "leak_mb_per_req" in body:
        value = _number(body["leak_mb_per_req"])
        if value is None or not 0 <= value <= MAX_LEAK_MB:
            return f"`leak_mb_per_req` must be a number in 0..{MAX_LEAK_MB}"
    if "error_rate" in body:
        value = _number(body["error_rate"])
        if value is None or not 0 <= value <= 1:
            return "`error_rate` must be a probability in 0..1"
    if "poison" in body and not isinstance(body["poison"], str):
        return "`poison` must be a string (empty: off)"
    return None


def holds(body: bytes, marker: str) -> bool:
    """Whether a request's body holds the poison ``marker``, as UTF-8 or as JSON escapes it
    (\u00ef: aiohttp's and the openai client's json): the same prompt either way, which only
    one of the two matched."""
    return marker.encode() in body or json.dumps(marker)[1:-1].encode() in body
