"""The load generator: replays a list of `Arrival` open loop against an OpenAI-compatible URL.

Open loop: each request is sent at its own time whatever the others do, so a slow strategy
meets the same offered load as a fast one, and its queues show in the latencies (a closed loop
would slow down with the system and hide them). Every request streams, so that the time to the
first content chunk (TTFT) is measured, and every request is bounded: a total timeout each,
and the run ends at the trace end plus a drain limit, whatever is still pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from promptlb.middleware._sse import marks_error

from ._scenario import Arrival

__all__ = [
    "CLASS_HEADER",
    "NODE_HEADER",
    "UNREADABLE",
    "UPSTREAM_HEADER",
    "Progress",
    "Result",
    "chat_body",
    "node_from_headers",
    "prompt_text",
    "replay",
    "request_once",
]

NODE_HEADER = "x-promptlb-node"
# Each request names its prompt class here; a gateway configured with this class_header trusts
# it (model_aware routes by it), and every other target ignores an unknown header.
CLASS_HEADER = "x-promptlb-class"
# What the peers (nginx's $upstream_addr, our LiteLLM server) answer: the upstream's host:port.
UPSTREAM_HEADER = "x-bench-upstream"
# What asking a gateway or emulator for its state may raise while it is down, slow or answers
# another shape: the question goes unanswered, never ends a run.
UNREADABLE = (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError)

_TEXT = (
    "route each prompt to the node that can answer it soonest while the others take the rest "
    "of the traffic without queueing behind a slow or failing model server "
)


@dataclass(slots=True)
class Result:
    """One request as the client saw it. Times are seconds from the start of the run."""

    index: int
    prompt_class: str
    max_tokens: int
    at: float  # when the trace says to send it
    start: float = 0.0  # when it was sent
    end: float = 0.0  # when it finished (ok or not)
    ttft: float | None = None  # first content chunk, from ``at``
    status: int = 0  # HTTP status; 0 when none came
    error: str = ""  # "" when ok, else a short kind: http_503, timeout, connect, truncated, ...
    node: str = "?"

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def latency(self) -> float:
        """From when the trace says to send it, not when the generator got to it: a generator
        that falls behind (it shares the cores with what it measures) must not take its own
        delay out of the numbers (coordinated omission). `lateness` says how far behind."""
        return self.end - self.at

    @property
    def lateness(self) -> float:
        return self.start - self.at

    def as_dict(self) -> dict[str, Any]:
        return {
            "i": self.index,
            "class": self.prompt_class,
            "max_tokens": self.max_tokens,
            "at": round(self.at, 4),
            "start": round(self.start, 4),
            "latency": round(self.latency, 4),
            "ttft": None if self.ttft is None else round(self.ttft, 4),
            "status": self.status,
            "error": self.error,
            "node": self.node,
        }


def prompt_text(tokens: int, index: int | None = None) -> str:
    """About ``tokens`` tokens of English (four characters a token, as the emulator counts),
    opening with request ``index`` when given: filler prompts share no prefix, so a node's
    prefix cache does not make a scenario without prompts cheaper than the simulator, which
    charges such a prompt's whole prefill (every filler cut the same text: after a node's
    first long prompt the others cost it nothing, and later runs met warm caches)."""
    chars = max(1, tokens) * 4
    head = "" if index is None else f"Request {index}. "
    repeats = chars // len(_TEXT) + 1
    return (head + _TEXT * repeats)[:chars]


def node_from_headers(headers: Mapping[str, str], upstreams: Mapping[str, str]) -> str:
    """The node that answered: promptlb's own header, else a peer's upstream address mapped to
    the node's name. nginx lists every upstream it tried ("a:1, b:2"): the last one answered."""
    if name := headers.get(NODE_HEADER):
        return name
    if addr := headers.get(UPSTREAM_HEADER):
        last = addr.split(",")[-1].strip().split(" : ")[-1].strip()
        return upstreams.get(last, last)
    return "?"


@dataclass(slots=True)
class Progress:
    """Live counts for a progress bar; the replay only adds to them."""

    total: int = 0
    sent: int = 0
    done: int = 0
    errors: int = 0
    started_at: float = 0.0  # loop.time() of the run's start; 0 until it starts


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "disconnected"
    if isinstance(exc, aiohttp.ClientOSError):
        return "reset"
    return type(exc).__name__


async def request_once(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    result: Result,
    clock: Callable[[], float],
    upstreams: Mapping[str, str],
    headers: Mapping[str, str],
) -> None:
    """Send one streamed chat completion and fill in ``result`` (``start`` is already set)."""
    try:
        async with http.post(url, data=body, headers=headers) as response:
            result.status = response.status
            result.node = node_from_headers(response.headers, upstreams)
            if response.status != 200:
                await response.read()
                result.error = f"http_{response.status}"
                return
            done = False
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                # Parsed only until the first content: after it, only [DONE] matters.
                if result.ttft is None and _has_content(data):
                    result.ttft = clock() - result.at
            if not done:
                result.error = "truncated"  # a 200 whose stream stopped before [DONE]
    except Exception as exc:  # any failure is the request's: never recorded as a success
        result.error = _error_kind(exc)
    finally:
        result.end = clock()


def _has_content(data: bytes) -> bool:
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    if not isinstance(chunk, dict):
        return False
    if marks_error(chunk):  # (a null "error" is none: its chunk's tokens are a first token)
        return False
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


def chat_body(model: str, arrival: Arrival, index: int = 0) -> bytes:
    """The request as sent: the arrival's own messages when it has them, else filler text of
    its length that shares no prefix with another request's (``index``, its place in the
    trace)."""
    if arrival.messages:
        messages = [{"role": role, "content": content} for role, content in arrival.messages]
    else:
        messages = [{"role": "user", "content": prompt_text(arrival.prompt_tokens, index)}]
    return json.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": arrival.max_tokens,
            "stream": True,
        }
    ).encode()


def request_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """Each request's limit, exactly ``seconds``: aiohttp rounds a total above its
    ``ceil_threshold`` (5 s) up to the loop clock's next whole second, so a 60 s limit cut
    requests off anywhere between 60 and 61 s, and answers in that second counted as
    successes (the peers' committed p99s of 60.2-60.7 s)."""
    return aiohttp.ClientTimeout(total=seconds, ceil_threshold=seconds)


async def replay(
    base_url: str | Sequence[str],
    trace: Sequence[Arrival],
    *,
    model: str,
    timeout_s: float = 60.0,
    drain_s: float = 60.0,
    upstreams: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    headers: Mapping[str, str] | None = None,
    on_start: Callable[[], None] | None = None,
) -> list[Result]:
    """Replay ``trace`` against ``base_url``'s ``/v1/chat/completions``; one Result each.
    Several base URLs (gateway replicas) take the requests in turn, as the simulator's
    replicas do.

    The bodies are built before the clock starts, so sending costs only the write. Requests
    still pending at the trace end + ``drain_s`` are cancelled and marked ``unfinished``.
    ``on_start`` runs when the clock starts (the fault schedule keys off the same moment).
    """
    bases = [base_url] if isinstance(base_url, str) else list(base_url)
    urls = [base.rstrip("/") + "/v1/chat/completions" for base in bases]
    upstreams = upstreams or {}
    send_headers = {"content-type": "application/json", **(headers or {})}
    by_class = {cls: {**send_headers, CLASS_HEADER: cls} for cls in {a.prompt_class for a in trace}}
    bodies = [chat_body(model, a, i) for i, a in enumerate(trace)]
    results = [Result(i, a.prompt_class, a.max_tokens, a.at) for i, a in enumerate(trace)]
    progress = progress or Progress()
    progress.total = len(trace)
    loop = asyncio.get_running_loop()
    # No connection limit: an open loop must never queue in the client's own pool.
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = request_timeout(timeout_s)
    pending: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = loop.time()
        progress.started_at = t0

        def clock() -> float:
            return loop.time() - t0

        async def one(result: Result, body: bytes) -> None:
            try:
                sent = by_class[result.prompt_class]
                url = urls[result.index % len(urls)]
                await request_once(http, url, body, result, clock, upstreams, sent)
            except asyncio.CancelledError:
                result.error = result.error or "unfinished"
                result.end = clock()
                raise
            finally:
                progress.done += 1
                if result.error:
                    progress.errors += 1

        if on_start is not None:
            on_start()
        for result, body in zip(results, bodies, strict=True):
            delay = result.at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            result.start = clock()
            task = asyncio.create_task(one(result, body))
            pending.add(task)
            task.add_done_callback(pending.discard)
            progress.sent += 1
        end = (trace[-1].at if trace else 0.0) + drain_s
        if pending:
            await asyncio.wait(set(pending), timeout=max(0.0, end - clock()))
        for task in list(pending):
            task.cancel()
        for task in list(pending):
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return results
