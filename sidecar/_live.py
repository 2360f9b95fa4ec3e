"""The sidecar's live view of its node, and the one snapshot encoding of it."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field

from promptlb.shared import (
    EPOCHS_V,
    MAX_AGE_MS,
    SEQ_EPOCH_BITS,
    EngineSample,
    GpuSample,
    Snapshot,
    encode,
)

from ._config import SidecarConfig
from ._model_server import WarmupReport

__all__ = ["Live", "Problem"]


class Problem:
    """Logs a condition once when it appears or changes, and once when it clears."""

    __slots__ = ("_log", "_what", "current")

    def __init__(self, log: logging.Logger, what: str) -> None:
        self._log = log
        self._what = what
        self.current = ""

    def report(self, message: str) -> None:
        if message != self.current:
            self.current = message
            self._log.warning("%s: %s", self._what, message)

    def clear(self) -> None:
        if self.current:
            self.current = ""
            self._log.info("%s: ok again", self._what)


_AGE_STEP_S = 0.1


@dataclass(slots=True)
class Live:
    """What the collectors last saw. Each change drops the cached encoding; ``/snapshot`` then
    encodes once, and serves those bytes until the next change (with an engine reading, for
    `_AGE_STEP_S` at most: its age grows)."""

    config: SidecarConfig
    boot: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    seq: int = 0
    sampled_at: float = 0.0
    host: tuple[float, float] | None = None
    gpus: tuple[GpuSample, ...] = ()
    engine: EngineSample | None = None
    engine_read_at: float = 0.0  # time.monotonic() of the reading in `engine`
    rss: int | None = None
    rss_slope: float | None = None
    mem_free: int | None = None
    server_ok: bool = False
    server_reason: str = "model server not probed yet"
    models: tuple[str, ...] = ()
    warm: bool = False
    warmup: WarmupReport | None = None
    draining: bool = False
    _encoded: bytes | None = None
    _encoded_at: float = 0.0  # time.monotonic() of `_encoded`
    _epoch_of: float = 0.0  # `engine_read_at` of the reading the current seq epoch began with

    def changed(self) -> None:
        self.sampled_at = time.time()
        self._encoded = None

    @property
    def warm_enough(self) -> bool:
        return self.warm or not self.config.warmup_required

    @property
    def ready(self) -> bool:
        return self.server_ok and self.warm_enough

    def reasons(self) -> list[str]:
        reasons = []
        if not self.server_ok:
            reasons.append(self.server_reason)
        if not self.warm_enough:
            last = self.warmup
            reasons.append(
                f"warmup failed: {last.error}" if last and not last.ok else "warmup not done"
            )
        if self.draining:
            reasons.append("draining")
        return reasons

    def snapshot(self) -> Snapshot:
        cfg = self.config
        return Snapshot(
            node=cfg.node_name,
            boot=self.boot,
            seq=self.seq,
            v=EPOCHS_V,
            ts=self.sampled_at or time.time(),
            ready=self.server_ok,
            warm=self.warm_enough,
            draining=self.draining,
            models=cfg.models or self.models,
            tags=cfg.tags,
            tier=cfg.tier,
            cpu=self.host[0] if self.host else None,
            mem=self.host[1] if self.host else None,
            gpus=self.gpus,
            engine=self._aged_engine(),
            rss=self.rss,
            rss_slope=self.rss_slope,
            mem_free=self.mem_free,
        )

    def _aged_engine(self) -> EngineSample | None:
        engine = self.engine
        if engine is None:
            return None
        # Kept through a late or failed scrape, the reading grows old while the other
        # collectors' ticks keep the snapshot fresh: its age says when it was read.
        age = round((time.monotonic() - self.engine_read_at) * 1000)
        return dataclasses.replace(engine, age_ms=min(max(age, 0), MAX_AGE_MS))

    def encoded(self) -> bytes:
        now = time.monotonic()
        if self._encoded is None:
            if self.engine_read_at != self._epoch_of:
                # A new engine reading: a new epoch (`Snapshot.same_reading`), where a gateway
                # re-bases its count of its own requests since the reading. Other news counts
                # up within it (past 255 of them, into the next: a re-base, as for a new one).
                self.seq = ((self.seq >> SEQ_EPOCH_BITS) + 1) << SEQ_EPOCH_BITS
                self._epoch_of = self.engine_read_at
            else:
                self.seq += 1
        elif self.engine is None or now - self._encoded_at <= _AGE_STEP_S:
            return self._encoded
        # An engine reading's age is true when encoded: bytes served a sample interval later
        # told a gateway first polling then that the reading was that much newer than it was
        # (its idle-engine proof reads it). Made again once older than `_AGE_STEP_S`, under
        # the same seq: nothing else changed, and a gateway that holds this seq keeps what it
        # took as no news (a new seq re-based its count of its own requests since the reading,
        # and kept a stalled sidecar's snapshot fresh).
        self._encoded = encode(self.snapshot(), self.config.sign_key)
        self._encoded_at = now
        return self._encoded
