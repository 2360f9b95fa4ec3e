"""Embedding micro-batching: concurrent ``/embeddings`` requests that could share one upstream
call are sent as one, and its answer is split back so that each caller sees only its own part.

`Batcher` works on parsed bodies and a per-caller `Fetch` (that caller's way upstream, with its
headers and route), so its logic runs without a network; `upstream` is the fetch the proxy
builds on `Dispatcher.answer`, so a batch is routed, retried and degraded like any request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["BATCH_HEADER", "Batcher", "Fetch", "Reply", "batch_key", "fail", "string_inputs"]

Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer: ``body`` when ``status`` is 200 (or a node's error, in OpenAI's shape),
    else what `json_error` needs."""

    status: int
    body: dict[str, Any] | None = None
    message: str = ""
    kind: str = ""
    param: str | None = None
    headers: Headers = ()


Fetch = Callable[[dict[str, Any]], Awaitable[Reply]]

# A merged request refused for what it carries: 400, 422 (TEI's validation) or 413 (a body
# limit in front of the node, which the merged body may pass where no caller's alone does).
_ONE_BY_ONE = frozenset({400, 413, 422})

BATCH_HEADER = b"x-promptlb-batch"  # the callers merged: the batcher's own
_FAILED = Reply(502, None, "the batched upstream call failed", "upstream_error")


def string_inputs(body: Mapping[str, Any]) -> list[str] | None:
    """The inputs of a body that may join a batch (a string or a non-empty list of strings);
    None for token arrays and anything else, which go upstream as they are."""
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    return None


def batch_key(path: str, body: Mapping[str, Any], *route: Hashable) -> Hashable:
    """Equal for requests that may share one upstream call: the same path, every body field
    but ``input`` equal, and the same ``route`` (priority, class, forwarded credentials...)."""
    rest = {k: v for k, v in body.items() if k != "input"}
    return (path, json.dumps(rest, sort_keys=True, separators=(",", ":")), *route)


@dataclass(slots=True, eq=False)
class _Member:
    body: dict[str, Any]
    inputs: list[str]
    fetch: Fetch
    future: asyncio.Future[Reply]
    alone: asyncio.Task[None] | None = None  # its own request, when asked again one by one


@dataclass(slots=True, eq=False)
class _Batch:
    key: Hashable
    members: list[_Member] = field(default_factory=list)
    size: int = 0  # inputs
    timer: asyncio.TimerHandle | None = None
    task: asyncio.Task[None] | None = None  # set once sent: members can no longer leave it


class Batcher:
    """Batches of requests with equal keys: sent when ``max_batch`` inputs are in or
    ``window`` seconds after the first arrived, whichever comes first."""

    def __init__(self, window: float, max_batch: int) -> None:
        self.window = window
        self.max_batch = max_batch
        self._open: dict[Hashable, _Batch] = {}
        self._running: set[asyncio.Task[None]] = set()  # the loop keeps only weak references

    async def submit(
        self, key: Hashable, body: dict[str, Any], inputs: list[str], fetch: Fetch
    ) -> Reply:
        """This caller's own answer. ``body`` (with ``inputs`` its strings) is what it sent;
        callers whose ``key`` is equal must differ in ``input`` only."""
        loop = asyncio.get_running_loop()
        batch = self._open.get(key)
        if batch is not None and batch.size + len(inputs) > self.max_batch:
            self._send(batch)
            batch = None
        if batch is None:
            batch = self._open[key] = _Batch(key)
            batch.timer = loop.call_later(self.window, self._send, batch)
        member = _Member(body, inputs, fetch, loop.create_future())
        batch.members.append(member)
        batch.size += len(inputs)
        if batch.size >= self.max_batch:
            self._send(batch)
        try:
            return await member.future
        except asyncio.CancelledError:
            self._leave(batch, member)
            raise

    def _leave(self, batch: _Batch, member: _Member) -> None:
        if batch.task is None:  # not sent yet: as if it had never come
            batch.members.remove(member)
            batch.size -= len(member.inputs)
            if not batch.members:
                self._close(batch)
        elif all(m.future.done() for m in batch.members):
            batch.task.cancel()  # nobody is left to answer: let the node see the disconnect
        elif member.alone is not None:
            # Asked again on its own: nobody reads that answer now (the node worked on it to
            # the batch's end).
            member.alone.cancel()

    def _close(self, batch: _Batch) -> None:
        if batch.timer is not None:
            batch.timer.cancel()
        if self._open.get(batch.key) is batch:
            del self._open[batch.key]

    def _send(self, batch: _Batch) -> None:
        if batch.task is not None:
            return
        self._close(batch)
        task = asyncio.ensure_future(self._run(list(batch.members)))
        batch.task = task
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, members: list[_Member]) -> None:
        merged = {**members[0].body, "input": [s for m in members for s in m.inputs]}
        try:
            reply = await members[0].fetch(merged)
            if reply.status in _ONE_BY_ONE and len(members) > 1:
                # One caller's bad input (or the merged body's size) fails the merged request:
                # ask again one by one, so that only its owner gets the error.
                for m in members:
                    if not m.future.done():
                        m.alone = asyncio.ensure_future(self._alone(m))
                await asyncio.gather(
                    *(m.alone for m in members if m.alone is not None), return_exceptions=True
                )
                return
            for member, own in zip(members, _split(reply, members), strict=True):
                if not member.future.done():
                    member.future.set_result(own)
        finally:
            # A fetch that raised (a bug: it answers errors as replies) must not leave a
            # caller waiting forever.
            for member in members:
                if not member.future.done():
                    member.future.set_result(_FAILED)

    async def _alone(self, member: _Member) -> None:
        if member.future.done():
            return
        reply = await member.fetch(member.body)
        if not member.future.done():
            member.future.set_result(_split(reply, [member])[0])


def _split(reply: Reply, members: list[_Member]) -> list[Reply]:
    """Each member's part of the upstream answer, re-indexed from 0; its ``usage`` is shared
    out in proportion to the characters each member sent (exact sums, largest remainder)."""
    n = len(members)
    headers = (*reply.headers, (BATCH_HEADER, str(n).encode()))
    if reply.status != 200 or reply.body is None:
        return [replace(reply, headers=headers)] * n
    body = reply.body
    total = sum(len(m.inputs) for m in members)
    data = _ordered(body.get("data"), total)
    if data is None:
        message = f"upstream answer has no valid `data` for {total} inputs"
        return [fail(502, message, "upstream_error", *headers)] * n
    usage = body.get("usage")
    shares: dict[str, list[int]] = {}
    if isinstance(usage, dict):
        weights = [sum(max(1, len(s)) for s in m.inputs) for m in members]
        for name, value in usage.items():
            if isinstance(value, int) and not isinstance(value, bool):
                shares[name] = _apportion(value, weights)
    out: list[Reply] = []
    start = 0
    for k, member in enumerate(members):
        end = start + len(member.inputs)
        own = {**body, "data": [{**d, "index": i} for i, d in enumerate(data[start:end])]}
        if isinstance(usage, dict):
            own["usage"] = {
                name: shares[name][k] if name in shares else v for name, v in usage.items()
            }
        out.append(Reply(200, own, headers=headers))
        start = end
    return out


def _ordered(data: object, total: int) -> list[dict[str, Any]] | None:
    """The embeddings in input order: by ``index`` when every item has one, else as listed."""
    if not isinstance(data, list) or len(data) != total:
        return None
    if not all(isinstance(d, dict) for d in data):
        return None
    indexes = [d.get("index") for d in data]
    if all(i is None for i in indexes):
        return data
    if all(type(i) is int for i in indexes) and sorted(indexes) == list(range(total)):
        return sorted(data, key=lambda d: int(d["index"]))
    return None


def _apportion(total: int, weights: list[int]) -> list[int]:
    whole = sum(weights)
    parts = [divmod(total * w, whole) for w in weights]
    shares = [q for q, _ in parts]
    for i in sorted(range(len(parts)), key=lambda i: -parts[i][1])[: total - sum(shares)]:
        shares[i] += 1
    return shares


def fail(
    status: int, message: str, kind: str, *headers: tuple[bytes, bytes], param: str | None = None
) -> Reply:
    return Reply(status, None, message, kind, param, headers)
