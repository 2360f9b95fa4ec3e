"""The launcher's Redis: started on a free port, answering, and gone once stopped."""

from __future__ import annotations

import os
from pathlib import Path

import redis
from promptlb.emulator import start_redis

from tests.conftest import need_binary


def test_a_throwaway_redis_answers_and_stop_leaves_nothing(tmp_path: Path) -> None:
    service = start_redis(need_binary("redis-server", "redis-server"), str(tmp_path))
    try:
        client = redis.Redis.from_url(service.url)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        client.close()
    finally:
        service.stop()
    assert service.proc.poll() is not None
    assert not os.path.exists(service.log_path)
    assert not list(tmp_path.iterdir())  # no dump: nothing persisted
