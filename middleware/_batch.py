"""Embedding micro-batching: concurrent ``/embeddings`` requests that could share one upstream
call are sent as one, and its answer is split back so that each caller sees only its own part.

`Batcher` works on parsed bodies and a per-caller `Fetch` (that caller's way upstream, with its
headers and route), so its logic runs without a network; `upstream` is the fetch the proxy
builds on `Dispatcher.answer`, so a batch is routed, retried and degraded like any request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from ._asgi import Message, Receive, Send, json_error, send_json
from ._balancer import UnknownModel, UpstreamError
from ._degrade import Answer, Dispatcher, Exhausted
from ._shedding import Shed
from ._strategies import NoNodeAvailable
from ._view import RouteRequest

__all__ = [
    "Batcher",
    "Fetch",
    "Reply",
    "batch_key",
    "respond",
    "string_inputs",
    "unless_gone",
    "upstream",
]

Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer: ``body`` when ``status`` is 200, else what `json_error` needs."""

    status: int
    body: dict[str, Any] | None = None
    message: str = ""
    kind: str = ""
    param: str | None = None
    headers: Headers = ()


Fetch = Callable[[dict[str, Any]], Awaitable[Reply]]

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
            if reply.status == 400 and len(members) > 1:
                # One caller's bad input fails the merged request: ask again one by one, so
                # that only its owner gets the error.
                await asyncio.gather(*(self._alone(m) for m in members))
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
    headers = (*reply.headers, (b"x-promptlb-batch", str(n).encode()))
    if reply.status != 200 or reply.body is None:
        return [replace(reply, headers=headers)] * n
    body = reply.body
    total = sum(len(m.inputs) for m in members)
    data = _ordered(body.get("data"), total)
    if data is None:
        message = f"upstream answer has no valid `data` for {total} inputs"
        return [_fail(502, message, "upstream_error", *headers)] * n
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


def upstream(
    dispatch: Dispatcher,
    request: RouteRequest,
    path: str,
    headers: Iterable[tuple[bytes, bytes]],
    *,
    no_fallback: bool,
    retry_after: bytes,
    shed_after: bytes,
) -> Fetch:
    """A caller's way upstream through the dispatcher, its refusals as `Reply`s (the same
    statuses and headers as the proxy's own answers)."""
    sent = list(headers)

    async def fetch(body: dict[str, Any]) -> Reply:
        raw = json.dumps(body).encode()
        req = replace(request, input_tokens=len(raw) // 4)
        try:
            async with dispatch.answer(req, path, body, raw, sent, no_fallback=no_fallback) as it:
                return await _read(it)
        except UnknownModel as exc:
            message = f"The model `{exc.model}` does not exist."
            return _fail(404, message, "model_not_found", param="model")
        except NoNodeAvailable as exc:
            return _fail(503, str(exc), "service_unavailable", (b"retry-after", retry_after))
        except Shed as exc:
            dispatch.balancer.metrics.shed.labels(request.priority).inc()
            return _fail(429, str(exc), "rate_limit_error", (b"retry-after", shed_after))
        except (UpstreamError, Exhausted) as exc:
            status, kind = (
                (exc.status, "upstream_error")
                if isinstance(exc, UpstreamError)
                else (503, "service_unavailable")
            )
            tries = (b"x-promptlb-attempts", str(exc.attempts).encode())
            return _fail(status, str(exc), kind, tries, (b"retry-after", retry_after))

    return fetch


def _fail(
    status: int, message: str, kind: str, *headers: tuple[bytes, bytes], param: str | None = None
) -> Reply:
    return Reply(status, None, message, kind, param, headers)


async def _read(answer: Answer) -> Reply:
    """The whole answer, parsed; a node's error as the node worded it."""
    up = answer.upstream
    headers = [
        (b"x-promptlb-node", b"cache" if up is None else up.node.name.encode()),
        (b"x-promptlb-model", answer.model.encode()),
        (b"x-promptlb-attempts", str(answer.attempts).encode()),
    ]
    if answer.degraded is not None:
        headers.append((b"x-promptlb-degraded", answer.degraded.encode()))
    status = 200
    if up is None:
        assert answer.entry is not None
        data = answer.entry.body
    else:
        status = up.response.status
        try:
            async with asyncio.timeout_at(up.deadline):
                data = answer.first + await up.response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            up.failed = True
            code = 504 if isinstance(exc, TimeoutError) else 502
            return _fail(code, f"upstream answer broke: {exc!r}", "upstream_error", *headers)
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    if status != 200:
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if not isinstance(error, dict):
            error = {}
        message = str(error.get("message") or f"upstream answered {status}")
        return _fail(status, message, str(error.get("type") or "upstream_error"), *headers)
    if not isinstance(parsed, dict):
        return _fail(502, "upstream answer is not a JSON object", "upstream_error", *headers)
    return Reply(200, parsed, headers=tuple(headers))


async def unless_gone(receive: Receive, work: Awaitable[Reply]) -> Reply | None:
    """``work``'s reply, or None when the client disconnects first (``work`` is cancelled,
    which takes the caller out of its batch)."""
    task = asyncio.current_task()
    assert task is not None
    gone = False
    waiting = True  # cancel only while waiting, never once the reply is in

    def on_message(future: asyncio.Future[Message]) -> None:
        nonlocal gone
        if (
            waiting
            and not future.cancelled()
            and future.exception() is None
            and future.result()["type"] == "http.disconnect"
        ):
            gone = True
            task.cancel()

    watcher = asyncio.ensure_future(receive())
    watcher.add_done_callback(on_message)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        return None
    finally:
        waiting = False
        if not watcher.done():
            watcher.remove_done_callback(on_message)
            watcher.cancel()


async def respond(send: Send, reply: Reply) -> None:
    headers = list(reply.headers)
    if reply.body is not None:
        await send_json(send, reply.status, reply.body, headers)
    else:
        await json_error(
            send, reply.status, reply.message, reply.kind, param=reply.param, headers=headers
        )
