"""The snapshot a sidecar serves: encoded once per change, an engine reading's age kept true."""

from __future__ import annotations

import time

from promptlb.shared import EngineSample, decode
from promptlb.sidecar import SidecarConfig
from promptlb.sidecar._live import _AGE_STEP_S, Live


def test_served_bytes_tell_an_engine_readings_age_as_of_now_not_as_of_their_encoding() -> None:
    live = Live(SidecarConfig(node_name="n"))
    live.engine = EngineSample(running=0, waiting=0)
    live.engine_read_at = time.monotonic()
    first = live.encoded()
    assert live.encoded() is first  # polls in one burst share the encoding
    time.sleep(_AGE_STEP_S + 0.1)
    # No collector changed anything meanwhile: the cached bytes said the reading was as old
    # as at their encoding, and a gateway polling now took it for that much newer.
    later = decode(live.encoded())
    assert later.engine is not None and later.engine.age_ms >= (_AGE_STEP_S + 0.1) * 1000
    # The same seq: no news to a gateway that holds the first (a new one re-based its count
    # of its own requests since the reading, on the same reading).
    assert later.seq == decode(first).seq


def test_without_an_engine_reading_the_bytes_stand_until_a_change() -> None:
    live = Live(SidecarConfig(node_name="n"))
    first = live.encoded()
    time.sleep(_AGE_STEP_S + 0.05)
    assert live.encoded() is first
    live.changed()
    assert decode(live.encoded()).seq == decode(first).seq + 1
