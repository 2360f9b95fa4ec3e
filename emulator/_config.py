"""The emulator's settings: one typed, keyword-only object that the CLI only forwards to."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from promptlb.shared import BLOCK_TOKENS, ConfigError

from ._faults import MAX_LEAK_MB, MAX_SLOW, MIN_SLOW

__all__ = ["MAX_OUTPUT_SPREAD", "EmulatorConfig"]

# The output length's log-normal sigma at most: past about 3 nearly every draw is 1 token.
MAX_OUTPUT_SPREAD = 10.0


def _positive(key: str, value: float, *, zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, value, "a finite number")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer past a float's range
        finite = False
    if not finite:
        raise ConfigError(key, value, "a finite number")
    if value < 0 or (value == 0 and not zero):
        raise ConfigError(key, value, "a number >= 0" if zero else "a number > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class EmulatorConfig:
    """An emulated OpenAI-compatible model server.

    Capacity: ``slots`` requests generate at once, each at ``tokens_per_s``, after ``ttft_ms``;
    the rest wait in a FIFO queue. Output length is the request's ``max_tokens`` when it gives one,
    else drawn from a log-normal around ``output_tokens`` (``output_spread`` is its sigma; 0 makes
    it fixed). Time is emulated with asyncio sleeps, never with CPU.

    KV cache (``_kv``): ``kv_blocks`` blocks of 16 tokens, prefixes cached as vLLM caches them;
    the prompt's tokens not found cached are prefilled at ``prefill_tokens_per_s`` on top of
    ``ttft_ms`` (0: prompt length costs nothing, and the cache saves nothing).
    """

    models: tuple[str, ...] = ("emulated",)
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = 8
    tokens_per_s: float = 50.0
    ttft_ms: float = 100.0
    prefill_tokens_per_s: float = 0.0  # 0: prompt length does not add to TTFT
    output_tokens: int = 64
    output_spread: float = 0.0
    max_queue: int = 10_000
    kv_blocks: int = 0  # KV-cache capacity in blocks of 16 tokens; 0: slots x 128 (2,048 tokens)
    embedding_dim: int = 16
    load_time_s: float = 0.0
    stream_interval_ms: float = 50.0
    error_rate: float = 0.0
    slow_factor: float = 1.0
    hang_after: int = 0
    crash_after: int = 0
    leak_mb_per_req: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise ConfigError("model", self.models, "one or more non-empty model names")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError("port", self.port, "a TCP port in 0..65535")
        for key in ("slots", "output_tokens", "embedding_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, value, "an integer >= 1")
        for key in ("max_queue", "kv_blocks", "hang_after", "crash_after"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(key, value, "an integer >= 0")
        _positive("tokens_per_s", self.tokens_per_s)
        _positive("slow_factor", self.slow_factor)
        if not MIN_SLOW <= self.slow_factor <= MAX_SLOW:
            raise ConfigError("slow_factor", self.slow_factor, f"in {MIN_SLOW:g}..{MAX_SLOW:g}")
        _positive("stream_interval_ms", self.stream_interval_ms)
        for key in ("ttft_ms", "prefill_tokens_per_s", "output_spread", "load_time_s"):
            _positive(key, getattr(self, key), zero=True)
        if self.output_spread > MAX_OUTPUT_SPREAD:
            # Its square overflowed in every draw: each request without max_tokens a 500.
            raise ConfigError("output_spread", self.output_spread, f"at most {MAX_OUTPUT_SPREAD}")
        _positive("leak_mb_per_req", self.leak_mb_per_req, zero=True)
        if self.leak_mb_per_req > MAX_LEAK_MB:
            raise ConfigError("leak_mb_per_req", self.leak_mb_per_req, f"at most {MAX_LEAK_MB}")
        if not isinstance(self.error_rate, int | float) or not 0.0 <= self.error_rate <= 1.0:
            raise ConfigError("error_rate", self.error_rate, "a probability in 0..1")

    @property
    def kv_capacity(self) -> int:
        """The KV cache's capacity in blocks."""
        return self.kv_blocks or self.slots * 128

    @property
    def context_tokens(self) -> int:
        """The most tokens a prompt and its answer may take together: the KV cache's, as
        vLLM's context is never longer than its cache."""
        return self.kv_capacity * BLOCK_TOKENS

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.repr and getattr(self, f.name) != f.default
        )
        return f"EmulatorConfig({shown})"
