"""Replicas sharing their prefix index through a real Redis: the exchange, what a broken
Redis or a stray entry costs (hit rate, never a request), and a conversation whose turns reach
two gateways, each routing by what the other sent."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgpack
import pytest
import redis.asyncio
import redis.utils
from promptlb.middleware._balancer import Balancer
from promptlb.middleware._config import IndexShareConfig, load_config
from promptlb.middleware._metrics import Metrics
from promptlb.middleware._nodes import Node, NodeTable
from promptlb.middleware._predictive import Predictive
from promptlb.middleware._prefix import INDEX_TOKENS, PrefixIndex, prompt_blocks
from promptlb.middleware._redis import connect
from promptlb.middleware._scoring import PowerOfTwoChoices
from promptlb.middleware._share import (
    _READ_COUNT,
    IndexShare,
    decode_finishes,
    decode_readings,
    decode_records,
    encode_finishes,
    encode_readings,
    encode_records,
)
from promptlb.middleware._view import RouteRequest
from promptlb.shared import BYTES_PER_TOKEN, ConfigError

from tests.conftest import RedisServer
from tests.middleware.conftest import MakeCluster, MakeNode, Messages

CHUNK = INDEX_TOKENS * BYTES_PER_TOKEN


def table() -> dict[str, Node]:
    """A node table of a, b and c: the nodes a replica learns about (others are left out)."""
    nodes = [{"name": n, "url": f"http://{n}:8000", "models": ["m"]} for n in "abc"]
    return NodeTable(load_config({"nodes": nodes})).nodes


def blocks(text: str) -> tuple[int, ...]:
    return prompt_blocks(text.encode())


def errors(metrics: Metrics, op: str) -> float:
    value = metrics.registry.get_sample_value("promptlb_index_share_errors_total", {"op": op})
    return value or 0.0


def share(
    url: str,
    index: PrefixIndex,
    metrics: Metrics,
    nodes: dict[str, Node] | None = None,
    **options: Any,
) -> IndexShare:
    config = IndexShareConfig(redis=url, **options)
    return IndexShare(config, index, table() if nodes is None else nodes, metrics)


def test_records_survive_the_wire_and_anything_else_is_refused() -> None:
    records = [("a", (1, 2**64 - 1)), ("b", ())]
    assert decode_records(encode_records(records)) == records
    for bad in (b"\xc1", encode_records([]) + b"x", b"\x91\x92\xa1a\x91\xa1x", b"\x81\xa1a\x01"):
        with pytest.raises(ValueError, match=r"msgpack|list|record"):
            decode_records(bad)


def test_finishes_survive_the_wire_and_garbage_is_refused() -> None:
    finishes = [("a", 3), ("b", 1)]
    assert decode_finishes(encode_finishes(finishes)) == finishes
    for bad in ([["a", 0]], [["a", -1]], [["a", 1.0]], [["a", True]], [["a"]], [[1, 1]], {"a": 1}):
        with pytest.raises(ValueError, match="finish"):
            decode_finishes(msgpack.packb(bad))


def test_readings_survive_the_wire_and_garbage_is_refused() -> None:
    readings = [("a", 20.0, 300.0, 0.5, 0.2, True), ("b", 0.0, 0.0, 1.0, None, False)]
    assert decode_readings(encode_readings(readings)) == readings
    good = ["a", 20, 300, 0.5, 0.2, True]
    for bad in (
        [good[:5]],  # a field short
        [["a", 20, 300, float("nan"), 0.2, True]],  # a NaN would wedge the fit
        [["a", 20, -1, 0.5, 0.2, True]],  # negative
        [["a", True, 300, 0.5, 0.2, True]],  # a bool is not a count
        [["a", 20, 300, 0.5, 0.2, 1]],  # nor a count a bool
        [[1, 20, 300, 0.5, 0.2, True]],
        {"a": good},
    ):
        with pytest.raises(ValueError, match="reading"):
            decode_readings(msgpack.packb(bad))
    with pytest.raises(ValueError, match="msgpack"):
        decode_readings(b"\xc1")


async def test_a_replica_learns_a_node_from_the_answers_another_had(
    redis_server: RedisServer, node: MakeNode
) -> None:
    metrics = Metrics(lambda: None)
    one, two = Predictive(PowerOfTwoChoices()), Predictive(PowerOfTwoChoices())
    assert one.index is not None and two.index is not None
    first = share(redis_server.url, one.index, metrics)
    second = share(redis_server.url, two.index, metrics)
    try:
        await first.exchange()
        await second.exchange()
        b = node("b")
        for tokens in (100, 900, 2000):
            req = RouteRequest(model="m", input_tokens=tokens, max_tokens=20, stream=True)
            one.observe(req, b, 0.3 + tokens / 1000, 0.1 + tokens / 1000, 0)
        await first.exchange()  # no prefix record, the readings alone make an entry
        await second.exchange()
        mine, theirs = one.model_of("b"), two.model_of("b")
        assert mine is not None and theirs is not None
        assert theirs.count == 3 and theirs.theta == mine.theta
        assert errors(metrics, "decode") == 0
    finally:
        await first.stop()
        await second.stop()


async def test_entries_of_either_version_are_read_and_bad_readings_skipped(
    redis_server: RedisServer, node: MakeNode
) -> None:
    metrics = Metrics(lambda: None)
    strategy = Predictive(PowerOfTwoChoices())
    assert strategy.index is not None
    reader = share(redis_server.url, strategy.index, metrics, key="k")
    raw = redis.asyncio.Redis.from_url(redis_server.url)
    reading = encode_readings([("a", 20.0, 300.0, 0.5, 0.2, True)])
    try:
        await reader.exchange()
        # the version before writes records alone; a peer's garbled readings or finishes
        # lose its entry
        await raw.xadd("k", {b"r": b"old", b"d": encode_records([("a", blocks("x" * CHUNK))])})
        await raw.xadd("k", {b"r": b"odd", b"d": encode_records([]), b"a": b"\x91\x91\xa1a"})
        await raw.xadd("k", {b"r": b"odd", b"d": encode_records([]), b"f": b"\x91\x92\xa1a\x00"})
        await raw.xadd("k", {b"r": b"new", b"d": encode_records([]), b"a": reading})
        await reader.exchange()
        assert errors(metrics, "decode") == 2
        assert strategy.index.matches(blocks("x" * CHUNK), [node("a")], 1) == {"a": 1}
        model = strategy.model_of("a")
        assert model is not None and model.count == 1
    finally:
        await raw.aclose()
        await reader.stop()


async def test_a_replica_learns_what_another_sent(
    redis_server: RedisServer, node: MakeNode
) -> None:
    metrics = Metrics(lambda: None)
    one, two = PrefixIndex(), PrefixIndex()
    mine, theirs = table(), table()
    first = share(redis_server.url, one, metrics, mine)
    second = share(redis_server.url, two, metrics, theirs)
    try:
        await first.exchange()  # each starts reading at the stream's end
        await second.exchange()
        prompt = blocks("s" * CHUNK * 3)
        one.record(node("b"), prompt, 1)
        one.record(node("c"), (), 2)
        one.record(node("elsewhere"), prompt, 3)  # not one of the reader's nodes
        one.finished("c")
        await first.exchange()
        await second.exchange()
        assert two.matches(prompt, [node("a"), node("b")], 4) == {"b": 3}
        load = {name: n.view.others_since_snapshot for name, n in theirs.items()}
        assert load == {"a": 0, "b": 1, "c": 0}  # c's request came and went
        await first.exchange()  # its own entry, read back, is skipped
        assert all(n.view.others_since_snapshot == 0 for n in mine.values())
        assert errors(metrics, "read") == errors(metrics, "write") == 0
    finally:
        await first.stop()
        await second.stop()


async def test_a_stray_entry_is_skipped_and_counted(
    redis_server: RedisServer, node: MakeNode
) -> None:
    metrics = Metrics(lambda: None)
    index = PrefixIndex()
    reader = share(redis_server.url, index, metrics, key="k")
    raw = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await reader.exchange()
        await raw.xadd("k", {b"r": b"someone", b"d": b"not msgpack \xc1"})
        await raw.xadd("k", {b"r": b"someone", b"d": encode_records([("a", blocks("x" * CHUNK))])})
        await reader.exchange()
        assert errors(metrics, "decode") == 1
        assert index.matches(blocks("x" * CHUNK), [node("a")], 1) == {"a": 1}  # the next one
    finally:
        await raw.aclose()
        await reader.stop()


def test_redis_replies_are_parsed_in_c() -> None:
    # Every round reads each other replica's entries: redis-py's pure-Python parser more than
    # doubled a round's CPU, so the redis extra installs hiredis, and the client must use it.
    assert redis.utils.HIREDIS_AVAILABLE  # installed, and a version redis-py accepts
    client, _ = connect("redis://127.0.0.1:9/0", 0.1)  # connects on first use: never here
    connection = client.connection_pool.make_connection()
    assert type(connection._parser).__name__ == "_AsyncHiredisParser"


async def test_a_backlog_longer_than_one_read_is_taken_in_one_round(
    redis_server: RedisServer,
) -> None:
    """A replica that fell behind (a stall, a burst of peers) reads batch after batch in one
    round, after the one that came back with its own write."""
    metrics = Metrics(lambda: None)
    index = PrefixIndex()
    nodes = table()
    reader = share(redis_server.url, index, metrics, nodes, key="k")
    raw = redis.asyncio.Redis.from_url(redis_server.url)
    backlog = _READ_COUNT * 2 + 5
    try:
        await reader.exchange()
        record = encode_records([("a", ())])
        async with raw.pipeline(transaction=False) as pipe:
            for _ in range(backlog):
                pipe.xadd("k", {b"r": b"peer", b"d": record})
            await pipe.execute()
        index.record(nodes["b"].view, (), 1)
        await reader.exchange()
        assert nodes["a"].view.others_since_snapshot == backlog
        assert nodes["b"].view.others_since_snapshot == 0  # its own, read back, skipped
        assert await raw.xlen("k") == backlog + 1  # and written in the same round
        assert errors(metrics, "read") == errors(metrics, "write") == 0
    finally:
        await raw.aclose()
        await reader.stop()


async def test_how_late_the_others_entries_are_learnt_is_measured(
    redis_server: RedisServer,
) -> None:
    """Entries Redis took two seconds before the read show as two seconds old; the replica's
    own entry, read back in the same round, is not counted."""
    metrics = Metrics(lambda: None)
    index = PrefixIndex()
    nodes = table()
    reader = share(redis_server.url, index, metrics, nodes, key="k")
    raw = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await reader.exchange()
        written = int(time.time() * 1000) - 2000
        record = encode_records([("a", ())])
        for seq in range(3):
            await raw.xadd("k", {b"r": b"peer", b"d": record}, id=f"{written}-{seq}")
        index.record(nodes["b"].view, (), 1)
        await reader.exchange()
        assert nodes["a"].view.others_since_snapshot == 3
        sample = metrics.registry.get_sample_value
        assert sample("promptlb_index_share_lag_seconds_count") == 3
        mean = (sample("promptlb_index_share_lag_seconds_sum") or 0.0) / 3
        assert 2.0 <= mean < 10.0  # read at once, but this machine may stall
        assert sample("promptlb_index_share_lag_seconds_bucket", {"le": "1.0"}) == 0
    finally:
        await raw.aclose()
        await reader.stop()


async def test_redis_down_costs_the_batch_never_an_error(
    redis_server: RedisServer, node: MakeNode, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics(lambda: None)
    index = PrefixIndex()
    replica = share(redis_server.url, index, metrics, timeout=0.1)
    try:
        await replica.exchange()
        redis_server.kill()
        for i in range(3):
            index.record(node("a"), blocks(f"{i}" * CHUNK), i)
            await replica.exchange()  # raises nothing
        assert errors(metrics, "write") == 3
        assert index.sent() == []  # dropped, not piled up for a Redis that may never return
        assert index.matches(blocks("2" * CHUNK), [node("a")], 9) == {"a": 1}  # own records stay
        warned = [r for r in caplog.records if "index sharing through Redis failed" in r.message]
        assert len(warned) == 1  # once per outage, not once per round
    finally:
        await replica.stop()


async def test_rounds_back_off_while_redis_is_away(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every 20 ms whatever happened: each failed round a new connection, 50 a second per
    # replica at a Redis that is restarting.
    metrics = Metrics(lambda: None)
    replica = share(redis_server.url, PrefixIndex(), metrics, every=0.02, timeout=0.1)
    rounds: list[float] = []
    exchange = replica.exchange

    async def counted() -> None:
        rounds.append(time.monotonic())
        await exchange()

    monkeypatch.setattr(replica, "exchange", counted)
    redis_server.kill()
    replica.start()
    try:
        await asyncio.sleep(1.5)
        # Backing off: 20, 40, 80 ... ms (jittered), a handful of rounds, not ~75.
        assert 3 <= len(rounds) <= 12, len(rounds)
        assert rounds[-1] - rounds[-2] > 0.2
    finally:
        await replica.stop()


async def test_a_write_redis_refuses_still_reads_the_others_entries(
    redis_server: RedisServer, node: MakeNode, caplog: pytest.LogCaptureFixture
) -> None:
    # Out of memory under noeviction (Redis's default), as when a cache shares the Redis: the
    # refused XADD failed the whole pipeline, and the read beside it was thrown away too.
    metrics = Metrics(lambda: None)
    one, two = PrefixIndex(), PrefixIndex()
    first = share(redis_server.url, one, metrics, key="k")
    second = share(redis_server.url, two, metrics, key="k")
    raw = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await first.exchange()
        await second.exchange()
        prompt = blocks("p" * CHUNK * 2)
        one.record(node("a"), prompt, 1)
        await first.exchange()
        await raw.config_set("maxmemory", 1)  # every write refused from now on
        with caplog.at_level(logging.INFO, "promptlb"):
            for _ in range(3):
                two.record(node("b"), blocks("q" * CHUNK), 1)
                await second.exchange()
            assert errors(metrics, "write") == 3
            assert two.matches(prompt, [node("a")], 2) == {"a": 2}
            await raw.config_set("maxmemory", 0)
            two.record(node("b"), blocks("q" * CHUNK), 1)
            await second.exchange()
        # Counted only, the replica stopped sharing with no word in its log: told once a
        # streak, as an outage is, and its end.
        said = [r.getMessage() for r in caplog.records if "writes" in r.getMessage()]
        assert len(said) == 2 and "refuses" in said[0] and "again" in said[1], said
    finally:
        await raw.config_set("maxmemory", 0)
        await raw.aclose()
        await first.stop()
        await second.stop()


def test_a_record_longer_than_a_reader_takes_is_cut_not_refused() -> None:
    long = tuple(range(5000))  # a 1.3M-token prompt, with max_body_bytes raised for it
    ((name, kept), (other, short)) = decode_records(encode_records([("a", long), ("b", (1, 2))]))
    assert (name, kept) == ("a", long[:4096])
    assert (other, short) == ("b", (1, 2))  # the rest of the entry is learnt


def raising_rounds(
    replica: IndexShare, monkeypatch: pytest.MonkeyPatch, raises: Callable[[int], bool]
) -> list[int]:
    """``replica``'s exchanges replaced by one that counts them (``[count]``, returned) and
    raises a bug on the ``n``-th where ``raises(n)``."""
    rounds = [0]

    async def exchange() -> None:
        rounds[0] += 1
        if raises(rounds[0]):
            raise KeyError("a reply of a shape this version does not know")

    monkeypatch.setattr(replica, "exchange", exchange)
    return rounds


async def test_a_round_that_raises_a_bug_is_counted_and_the_next_runs(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics(lambda: None)
    replica = share(redis_server.url, PrefixIndex(), metrics, every=0.02)
    rounds = raising_rounds(replica, monkeypatch, lambda n: n == 1)
    replica.start()
    try:
        for _ in range(100):
            if rounds[0] >= 3:
                break
            await asyncio.sleep(0.02)
        assert rounds[0] >= 3  # sharing went on after the bad round
        assert errors(metrics, "bug") == 1
        assert any("index share round failed" in r.message for r in caplog.records)
    finally:
        await replica.stop()


async def test_rounds_that_keep_raising_back_off_and_log_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Every 20 ms a traceback and a round, for ever, while a reply's shape was misread.
    metrics = Metrics(lambda: None)
    replica = share(redis_server.url, PrefixIndex(), metrics, every=0.02)
    rounds = raising_rounds(replica, monkeypatch, lambda n: True)
    replica.start()
    try:
        await asyncio.sleep(0.6)  # 30 rounds at the configured pace
    finally:
        await replica.stop()
    assert 2 <= rounds[0] <= 10, rounds  # backed off as for an outage: 20, 40, 80, 160 ms...
    # Each counted, for the alert (but the last hand-on at the stop, which is not a round).
    assert errors(metrics, "bug") == rounds[0] - 1
    assert len([r for r in caplog.records if "round failed" in r.message]) == 1


async def test_a_replica_that_stops_hands_on_what_it_recorded_since_its_last_round(
    redis_server: RedisServer, node: MakeNode
) -> None:
    # A reload or a shutdown between two rounds: the others kept counting its last tries as
    # load on their nodes until the next snapshots.
    metrics = Metrics(lambda: None)
    one, two = PrefixIndex(), PrefixIndex()
    theirs = table()
    first = share(redis_server.url, one, metrics, every=60)
    second = share(redis_server.url, two, metrics, theirs)
    try:
        first.start()
        await first.exchange()
        await second.exchange()
        one.record(node("a"), blocks("s" * CHUNK), 1)
        one.record(node("b"), (), 2)
        one.finished("b")
    finally:
        await first.stop()  # no round ran since the records
    try:
        await second.exchange()
        assert two.matches(blocks("s" * CHUNK), [node("a")], 3) == {"a": 1}
        assert theirs["b"].view.others_since_snapshot == 0  # its start and its end both came
        assert theirs["a"].view.others_since_snapshot == 1
    finally:
        await second.stop()


async def test_a_replica_that_stops_while_redis_is_away_does_not_wait_on_it(
    redis_server: RedisServer, node: MakeNode
) -> None:
    # A reload or a shutdown while Redis hangs: the last round would wait out its timeout,
    # holding the reload (and the shutdown behind it).
    metrics = Metrics(lambda: None)
    index = PrefixIndex()
    replica = share(redis_server.url, index, metrics, timeout=5.0, every=60)
    replica.start()
    await replica.exchange()
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # Redis hangs
    try:
        index.record(node("a"), blocks("z" * CHUNK), 1)
        await replica.exchange()  # times out: Redis is away
        started = time.monotonic()
        await replica.stop()
        assert time.monotonic() - started < 2.0  # not the 5 s timeout again
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)


def test_the_config_names_what_is_wrong() -> None:
    nodes = [{"name": "a", "url": "http://127.0.0.1:9"}]
    cases = [
        ({"redis": "http://x"}, "index_share.redis"),
        ({"redis": "redis://x", "every": "1ms"}, "index_share.every"),
        ({"redis": "redis://x", "max_entries": 10}, "index_share.max_entries"),
        ({}, "index_share.redis"),
    ]
    for table, key in cases:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config({"nodes": nodes, "index_share": table})
    # Only a cache-aware strategy has an index to share.
    plain = load_config(
        {"nodes": nodes, "strategy": "p2c", "index_share": {"redis": "redis://127.0.0.1:9"}}
    )
    with pytest.raises(ConfigError, match="index_share"):
        Balancer(plain)
    off = load_config(
        {
            "nodes": nodes,
            "strategy_options": {"cache_aware": False},
            "index_share": {"redis": "redis://127.0.0.1:9"},
        }
    )
    with pytest.raises(ConfigError, match="index_share"):
        Balancer(off)


async def test_a_conversation_follows_its_cache_across_two_gateways(
    cluster: MakeCluster, redis_server: RedisServer
) -> None:
    """Turn 1 through one gateway, turn 2 through another: the second routes by what the
    first sent. ``cold_slack = 0`` turns off the rendezvous agreement on new prefixes, so
    without the shared index the second gateway would follow by chance (one in three)."""
    node_flags = ("--ttft-ms", "5", "--prefill-tokens-per-s", "5000", "--tokens-per-s", "2000")
    config = (
        "strategy = 'predictive'\n"
        "[strategy_options]\ncold_slack = 0\n"
        f"[index_share]\nredis = '{redis_server.url}'\nevery = '50ms'\n"
    )
    c = cluster({n: node_flags for n in "abc"}, config)
    other = c.another_app()
    rng = random.Random(3)

    async def ask(http: aiohttp.ClientSession, url: str, messages: Messages) -> str:
        body = {"model": "m", "messages": messages, "max_tokens": 4}
        async with http.post(url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            return response.headers["x-promptlb-node"]

    async with aiohttp.ClientSession() as http:
        for i in range(12):  # both learn every node's speed, from misses of all sizes
            for url in (c.app.url, other.url):
                content = f"{i} " + "w" * rng.randint(100, 8000)
                await ask(http, url, [{"role": "user", "content": content}])
        followed = 0
        for conv in range(9):
            messages: Messages = [{"role": "system", "content": f"tenant {conv}: " + "r " * 5000}]
            messages.append({"role": "user", "content": "first question"})
            first = await ask(http, c.app.url, messages)
            await asyncio.sleep(0.3)  # a few exchanges
            messages += [
                {"role": "assistant", "content": "an answer"},
                {"role": "user", "content": "a follow-up"},
            ]
            followed += await ask(http, other.url, messages) == first
    assert followed >= 8  # of 9; by chance, about 3
