"""Gateway replicas share their prefix index through a Redis stream (``[index_share]``).

Each replica routes 1/N of the traffic and so, alone, knows 1/N of what each node holds in its
KV cache: in the simulator, 8 independent replicas on multi-tenant-chat hit 0.25 of the prompt
tokens where one replica routing everything hit 0.57. Every ``every`` a replica appends what it
recorded since (node, coarse block hashes) as one stream entry, and reads the entries the
others appended since its last read into its own index. The same records count the others'
requests sent to each node since that node's last snapshot: load the snapshot cannot show yet.
The entry also carries the answers the replica's strategy learnt from (`Reading`, field ``a``),
so that each replica's model of a node learns from every replica's answers, and the tries that
ended per node (field ``f``), which take the others' requests off the nodes' queues again.

One task per balancer, never per request; the request path only appends to a list. Redis down,
slow or answering garbage costs hit rate, never a request: the batch is dropped, the failure
counted (``promptlb_index_share_errors_total{op}``) and logged once per outage, and the next
round tries again. How old the others' entries are when read, from their write to Redis
(``promptlb_index_share_lag_seconds``), tells whether reading keeps up: a replica starved of
CPU learns late, and routes on what the others sent a while ago. (A record also waits up to
one ``every`` in its writer's batch, which an entry's age leaves out.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import msgpack

from ._config import IndexShareConfig
from ._metrics import Metrics
from ._prefix import OUTBOX_RECORDS, PrefixIndex, Reading
from ._redis import connect
from ._view import NodeView

if TYPE_CHECKING:
    from ._nodes import Node

__all__ = [
    "IndexShare",
    "decode_finishes",
    "decode_readings",
    "decode_records",
    "encode_finishes",
    "encode_readings",
    "encode_records",
]

log = logging.getLogger("promptlb.middleware")

_READ_COUNT = 512  # entries per XREAD; a round reads at most a few of those
_READS_PER_ROUND = 8
_DOWN_PAUSE_S = 5.0  # the longest pause between rounds while Redis is away
_MAX_BLOCKS = 4096  # per record: a 1M-token prompt in 256-token blocks
_MAX_READING = 1e9  # tokens or seconds: beyond, a reading is garbage, not a slow node
_MAX_ENDED = 1_000_000  # tries ended on one node in one round


def _pack(rows: Iterable[Sequence[object]]) -> bytes:
    packed: bytes = msgpack.packb([list(row) for row in rows], use_bin_type=True)
    return packed


def encode_records(records: Sequence[tuple[str, Sequence[int]]]) -> bytes:
    # A tuple of blocks packs as the array it is read back as. Cut to what a reader takes: a
    # prompt longer than that (max_body_bytes raised for long contexts) made every reader
    # refuse the whole entry, the others' records and finishes in it too; its head is the
    # prefix that matters.
    return _pack(
        (name, blocks if len(blocks) <= _MAX_BLOCKS else blocks[:_MAX_BLOCKS])
        for name, blocks in records
    )


def _items(raw: bytes, what: str) -> list[object]:
    """A field's msgpack list of at most an outbox's worth of items, or `ValueError`."""
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError) as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(data, list) or len(data) > OUTBOX_RECORDS:
        raise ValueError(f"not a list of {what}")
    return data


def decode_records(raw: bytes) -> list[tuple[str, tuple[int, ...]]]:
    """The records of one entry; `ValueError` for anything not written by `encode_records`
    (a peer on another version, a stray writer): one bad entry must not poison the index."""
    data = _items(raw, "records")
    records: list[tuple[str, tuple[int, ...]]] = []
    for item in data:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], list)
            or len(item[1]) > _MAX_BLOCKS
            or not all(type(b) is int for b in item[1])
        ):
            raise ValueError("a record is not [node, [block, ...]]")
        records.append((item[0], tuple(item[1])))
    return records


def encode_readings(readings: Sequence[Reading]) -> bytes:
    return _pack(readings)


def _amount(value: object, *, optional: bool = False) -> bool:
    if value is None:
        return optional
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and 0 <= value <= _MAX_READING


def decode_readings(raw: bytes) -> list[Reading]:
    """The readings of one entry; `ValueError` for anything `encode_readings` did not write: a
    garbled reading must not teach a model (a negative time, a NaN would wedge it)."""
    data = _items(raw, "readings")
    readings: list[Reading] = []
    for item in data:
        if (
            not isinstance(item, list)
            or len(item) != 6
            or not isinstance(item[0], str)
            or not all(_amount(v) for v in item[1:4])
            or not _amount(item[4], optional=True)
            or type(item[5]) is not bool
        ):
            raise ValueError("a reading is not [node, out, prefill, service, decode, head]")
        name, out, prefill, service, decode, head = item
        readings.append((name, float(out), float(prefill), float(service), _float(decode), head))
    return readings


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def encode_finishes(finishes: Sequence[tuple[str, int]]) -> bytes:
    return _pack(finishes)


def decode_finishes(raw: bytes) -> list[tuple[str, int]]:
    """Per node, the tries that ended; `ValueError` for anything `encode_finishes` did not
    write (a garbled count would leave load on a node, or take it off, for good)."""
    finishes: list[tuple[str, int]] = []
    for item in _items(raw, "finishes"):
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or type(item[1]) is not int
            or not 0 < item[1] <= _MAX_ENDED
        ):
            raise ValueError("a finish is not [node, count]")
        finishes.append((item[0], item[1]))
    return finishes


class IndexShare:
    """Exchanges ``index``'s records with the other replicas every ``config.every``; only
    records about ``nodes`` (this replica's node table, read each round) are learnt."""

    def __init__(
        self,
        config: IndexShareConfig,
        index: PrefixIndex,
        nodes: Mapping[str, Node],
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._index = index
        self._nodes = nodes
        self._metrics = metrics
        self._client, self._errors = connect(config.redis, config.timeout)
        self.replica = secrets.token_hex(8)  # to skip our own entries when reading
        self._last_id: bytes | None = None  # None: read from the stream's end at first
        self._down = False
        self._refused = False  # Redis refuses our writes (told once a streak)
        self._task: asyncio.Task[None] | None = None
        index.share()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="promptlb-index-share")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            # What was recorded since the last round, the tries' ends above all, goes out:
            # the others would count those tries as load until the nodes' next snapshots.
            # Bounded, and nothing if Redis is away (a shutdown must not wait on it).
            if not self._down:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self._config.timeout):
                        await self.exchange()
        # A reload that keeps sharing starts a new exchange, which shares again at once.
        self._index.unshare()
        await self._client.aclose()

    async def _run(self) -> None:
        every = self._config.every
        pause = every
        failing = False  # rounds raising, in a row
        while True:
            await asyncio.sleep(pause)
            try:
                await self.exchange()
            except Exception:  # a bug in one round must not end sharing for good, unseen
                self._metrics.index_share_errors.labels("bug").inc()
                if not failing:  # once a streak: a reply this version misreads recurs
                    log.exception("promptlb: an index share round failed; the next one runs")
                failing = True
            else:
                if failing:
                    log.info("promptlb: index share rounds run again")
                failing = False
            if self._down or failing:
                # Redis away (or every round raising): the rounds back off, doubling to
                # `_DOWN_PAUSE_S`, jittered. Each failed round opens a connection: 50 a second
                # per replica, a hundred replicas a storm of SYNs at a Redis that is
                # restarting or failing over; a bug's traceback 50 times a second.
                longest = max(_DOWN_PAUSE_S, every)  # never more often than configured
                pause = max(every, min(longest, 2 * pause) * random.uniform(0.8, 1.2))
            else:
                pause = every

    async def exchange(self) -> None:
        """One round: write what was recorded since the last and read the others', in one
        round trip (a pipeline, not a transaction: the two need not be atomic)."""
        records, readings, finishes = self._index.drain()
        client, key = self._client, self._config.key
        fields: dict[bytes, bytes | str] | None = None
        if records or readings or finishes:
            # ``d`` even when empty: a replica of the version before reads it alone
            fields = {b"r": self.replica, b"d": encode_records(records)}
            if readings:
                fields[b"a"] = encode_readings(readings)
            if finishes:
                fields[b"f"] = encode_finishes(finishes)
        op = "read" if fields is None else "write"
        try:
            pipe = client.pipeline(transaction=False)
            if fields is not None:
                pipe.xadd(key, fields, maxlen=self._config.max_entries, approximate=True)
            starting = self._last_id is None
            if starting:
                # A replica starting learns from now on: older entries name requests long
                # done, and would count as load on nodes that finished them.
                pipe.xrevrange(key, count=1)
            else:
                pipe.xread({key: self._last_id}, count=_READ_COUNT)
            # A write Redis refuses (out of memory, a read-only replica) must not throw away
            # the read beside it: the others' records still come.
            replies = await pipe.execute(raise_on_error=False)
            got = replies[-1]
            if fields is not None:
                self._wrote(replies[0])
            op = "read"
            if isinstance(got, BaseException):
                raise got
            if starting:
                self._last_id = got[0][0] if got else b"0-0"
            else:
                reads = 1
                while self._learn(got[0][1] if got else []) and reads < _READS_PER_ROUND:
                    got = await client.xread({key: self._last_id}, count=_READ_COUNT)
                    reads += 1
        except self._errors as exc:
            self._metrics.index_share_errors.labels(op).inc()
            if not self._down:
                self._down = True
                log.warning(
                    "promptlb: index sharing through Redis failed (%s: %s); routing goes on "
                    "with this replica's own records until it answers again",
                    type(exc).__name__,
                    exc,
                )
            return
        if self._down:
            self._down = False
            log.info("promptlb: index sharing through Redis works again")

    def _wrote(self, reply: object) -> None:
        """Count and tell (once a streak, as an outage is) a write Redis refused while it
        answered the read: out of memory under ``noeviction``, a replica made read-only by a
        failover. Counted only, the replica stopped sharing with no word in its log."""
        if isinstance(reply, BaseException):
            self._metrics.index_share_errors.labels("write").inc()
            if not self._refused:
                self._refused = True
                log.warning(
                    "promptlb: Redis refuses this replica's index share writes (%s: %s); the "
                    "others no longer learn what it sends until it takes them again",
                    type(reply).__name__,
                    reply,
                )
        elif self._refused:
            self._refused = False
            log.info("promptlb: Redis takes this replica's index share writes again")

    def _learn(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> bool:
        """The others' entries into the index; whether a full batch came (more may wait)."""
        index = self._index
        views: dict[str, NodeView] | None = None
        mine = self.replica.encode()
        lag = self._metrics.index_share_lag
        # An entry's id is Redis's clock (ms) at the write, held against ours: hosts kept in
        # step by NTP agree to a few ms, and a skew that makes an entry look young reads as 0.
        now_ms = time.time() * 1000.0
        for entry_id, fields in entries:
            self._last_id = entry_id
            if fields.get(b"r") == mine:
                continue
            try:
                records = decode_records(fields.get(b"d", b""))
                readings = decode_readings(fields[b"a"]) if b"a" in fields else []
                finishes = decode_finishes(fields[b"f"]) if b"f" in fields else []
            except ValueError as exc:
                self._metrics.index_share_errors.labels("decode").inc()
                log.debug("promptlb: index share entry %r skipped: %s", entry_id, exc)
                continue
            if views is None:  # the table as it is now: nodes come and go on reloads
                views = {name: node.view for name, node in self._nodes.items()}
            index.take(records, readings, finishes, views)
            lag.observe(max(0.0, now_ms - int(entry_id.split(b"-", 1)[0])) / 1000.0)
        return len(entries) >= _READ_COUNT
