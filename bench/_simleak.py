"""A simulated model server's memory, as its sidecar reports it: what the gateway's leak drain
(`middleware._nodes.leak_mark`) reads. Only nodes with a ``memory_limit_mb`` keep one, as only
their sidecars, live, project a time to OOM against a limit of the scenario's own.

The live emulator maps ``leak_mb_per_req`` for every request that reaches it (`emulator._faults`);
the sidecar fits its RSS's slope over `RSS_WINDOW_S` (the live runner's ``--rss-window``). Here
the slope is the growth over that window, which a steady leak makes its rate, and which grows
into it over the window's first seconds as the sidecar's fit of a flat stretch and a rising one
does. A crash loses the process: the recovered one starts from its idle RSS, with no leak (the
live runner starts it with its original flags)."""

from __future__ import annotations

from collections import deque

from ._scenario import RSS_WINDOW_S

__all__ = ["IDLE_RSS_MB", "Memory"]

# The emulator's own RSS, idle and after 64 requests (the seed-3am scenario's measurement).
IDLE_RSS_MB = 42.0
_MiB = 2**20


class Memory:
    """One node's model-server memory over virtual time."""

    __slots__ = ("boot", "history", "limit_mb", "per_request_mb", "rss_mb")

    def __init__(self, limit_mb: float) -> None:
        self.limit_mb = limit_mb
        self.per_request_mb = 0.0  # the leak fault's value, while it lasts
        self.rss_mb = IDLE_RSS_MB
        self.boot = 0  # a new process, a new boot: what ends a leak's drain
        self.history: deque[tuple[float, float]] = deque()  # (time, RSS from then on)

    def request(self, now: float) -> bool:
        """A request reached the server: its share of the leak. True if the RSS moved."""
        if not self.per_request_mb:
            return False
        self.rss_mb += self.per_request_mb
        self.history.append((now, self.rss_mb))
        return True

    def restart(self) -> None:
        self.per_request_mb = 0.0
        self.rss_mb = IDLE_RSS_MB
        self.boot += 1
        self.history.clear()

    def reading(self, now: float) -> tuple[int, float, int]:
        """RSS (bytes), its slope (bytes/s) and the bytes left before the limit, at ``now``."""
        history = self.history
        start = now - RSS_WINDOW_S
        # The RSS at the window's start: the last change at or before it (dropped once a later
        # one is too), or the idle RSS before the first.
        while len(history) > 1 and history[1][0] <= start:
            history.popleft()
        then = IDLE_RSS_MB
        if history and history[0][0] <= start:
            then = history[0][1]
        slope = (self.rss_mb - then) / RSS_WINDOW_S
        free = max(0.0, self.limit_mb - self.rss_mb)
        return round(self.rss_mb * _MiB), slope * _MiB, round(free * _MiB)

    @property
    def changing(self) -> bool:
        """Whether its reading moves with time alone (the slope's window slides)."""
        return bool(self.history)
