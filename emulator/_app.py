"""The emulated model server: OpenAI-compatible endpoints over the capacity model."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import random
import struct
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._capacity import Capacity, QueueFull
from ._config import EmulatorConfig

__all__ = ["create_app"]

log = logging.getLogger("promptlb.emulator")

_TEXT = (
    "the quick brown fox jumps over a lazy dog while small models answer fast and big models "
    "think long about every prompt they are given"
)
_WORDS = tuple(_TEXT.split(" "))
_MiB = 1024 * 1024


@dataclass(slots=True)
class _Stats:
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: int = 0
    errors: int = 0
    cancelled: int = 0  # generations abandoned because the client went away
    prefix_queries: int = 0  # generations that looked their prompt's prefix up ...
    prefix_hits: int = 0  # ... and found it cached
    prefix_query_tokens: int = 0  # the same in prompt tokens, as vLLM counts them
    prefix_hit_tokens: int = 0
    leaked: list[bytearray] = field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "success": self.success,
            "errors": self.errors,
            "cancelled": self.cancelled,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
        }


@dataclass(slots=True)
class _Faults:
    """The faults that can change while the process runs (``POST /_emulator/faults``); the CLI
    flags are only their starting values. A benchmark plays a scenario's faults over time with
    them, without restarting the process (which would reset its queue and its leaked memory)."""

    slow_factor: float = 1.0
    leak_mb_per_req: float = 0.0
    error_rate: float = 0.0
    # Set while the node is hung: requests wait on it, then go on once the hang is lifted, as
    # the work queued on a stalled server does when it recovers.
    running: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.running.set()

    @property
    def hang(self) -> bool:
        return not self.running.is_set()

    def as_dict(self) -> dict[str, Any]:
        return {
            "slow_factor": self.slow_factor,
            "hang": self.hang,
            "leak_mb_per_req": self.leak_mb_per_req,
            "error_rate": self.error_rate,
        }


@dataclass(slots=True)
class _State:
    config: EmulatorConfig
    capacity: Capacity
    rng: random.Random
    ready_at: float
    faults: _Faults
    stats: _Stats = field(default_factory=_Stats)
    # Prefix hashes of recent prompts, least recently used first: the node's KV prefix cache.
    prefixes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)


STATE = web.AppKey("promptlb_emulator_state", _State)


class _VllmMetrics(Collector):
    """vLLM-style families, read from the live state at scrape time."""

    def __init__(self, state: _State) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state
        model = state.config.models[0]
        cap = state.capacity

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            cap.running,
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", cap.waiting
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            min(1.0, cap.kv_used / state.config.kv_capacity),
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", state.stats.prompt_tokens
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            state.stats.generation_tokens,
        )
        yield counter(
            "vllm:request_success", "Count of successfully processed requests.", state.stats.success
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            state.stats.prefix_query_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            state.stats.prefix_hit_tokens,
        )


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


def _estimate_tokens(value: object) -> int:
    """About four characters a token, as tokenizers average on English text."""
    if isinstance(value, str):
        return max(1, math.ceil(len(value) / 4))
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # a pre-tokenised prompt
        return sum(_estimate_tokens(v) for v in value)
    if isinstance(value, dict):
        return _estimate_tokens(value.get("content", "")) + 4
    return 1


def _prefix(prompt: object, limit: int) -> str:
    """The first ``limit`` characters of a prompt as an engine's chat template would lay it out
    (role, then content, message by message); all of a shorter one."""
    if isinstance(prompt, str):
        return prompt[:limit]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        parts: list[str] = []
        size = 0
        for message in prompt:
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(
                    p["text"]
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            piece = f"{message.get('role', '')}\n{content if isinstance(content, str) else ''}\n"
            parts.append(piece)
            size += len(piece)
            if size >= limit:
                break
        return "".join(parts)[:limit]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0][:limit]
    return json.dumps(prompt)[:limit]  # token ids and the odd shape: their JSON text


def _words(start: int, count: int) -> str:
    return "".join(_WORDS[(start + i) % len(_WORDS)] + " " for i in range(count))


class _Handlers:
    def __init__(self, state: _State) -> None:
        self.state = state
        self.cfg = state.config

    async def _admit(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The checks every generation request goes through, in the order a server fails."""
        state, cfg = self.state, self.cfg
        if time.monotonic() < state.ready_at:
            return _error(503, "model is loading", "service_unavailable")
        state.stats.requests += 1
        seen = state.stats.requests
        if cfg.crash_after and seen > cfg.crash_after:
            log.error("crash_after=%d reached: exiting", cfg.crash_after)
            os._exit(3)  # a crash, not a shutdown: no cleanup, connections reset
        if cfg.hang_after and seen > cfg.hang_after:
            await asyncio.get_running_loop().create_future()  # until the client gives up
        await state.faults.running.wait()  # a runtime hang: until it is lifted or the client goes
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        model = body.get("model", cfg.models[0])
        if model not in cfg.models:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        faults = state.faults
        if faults.error_rate and state.rng.random() < faults.error_rate:
            state.stats.errors += 1
            return _error(500, "emulated internal error", "internal_server_error")
        if faults.leak_mb_per_req:
            leak = bytearray(int(faults.leak_mb_per_req * _MiB))
            leak[::4096] = b"\x01" * len(range(0, len(leak), 4096))  # touch pages: real RSS
            state.stats.leaked.append(leak)
        return body

    def _output_tokens(self, body: dict[str, Any]) -> int:
        asked = body.get("max_tokens", body.get("max_completion_tokens"))
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
            return asked
        cfg = self.cfg
        if cfg.output_spread <= 0:
            return cfg.output_tokens
        mu = math.log(cfg.output_tokens) - cfg.output_spread**2 / 2  # keeps the mean
        return max(1, round(self.state.rng.lognormvariate(mu, cfg.output_spread)))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._admit(request)
        if isinstance(body, web.Response):
            return body
        prompt = body.get("messages") if chat else body.get("prompt")
        if prompt is None:
            field_name = "messages" if chat else "prompt"
            return _error(400, f"`{field_name}` is required", "invalid_request_error")
        cfg, state = self.cfg, self.state
        n_in = _estimate_tokens(prompt)
        n_out = self._output_tokens(body)
        slow = state.faults.slow_factor  # read once: a change applies to requests that start after
        rate = cfg.tokens_per_s / slow
        ttft = cfg.ttft_ms / 1000 * slow
        if cfg.prefill_tokens_per_s:
            ttft += n_in / cfg.prefill_tokens_per_s * slow
        model = body.get("model", cfg.models[0])
        stream = body.get("stream") is True
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            # Checked now: once the stream has started, a 200 is already on the wire.
            return _error(400, "`stream_options` must be an object", "invalid_request_error")
        reply = _Reply(chat=chat, model=model, n_in=n_in, n_out=n_out, body=body)
        head = _prefix(prompt, cfg.prefix_chars)
        prefix = hashlib.blake2b(head.encode(), digest_size=16).digest()
        try:
            async with state.capacity.slot():
                reserved = n_in + n_out
                state.capacity.kv_used += reserved
                try:
                    # Looked up when prefill starts (the slot is ours), stored once it is done:
                    # a twin request prefilling at the same time does not find it yet.
                    if self._prefix_hit(prefix, n_in, len(head)):
                        ttft *= 1.0 - cfg.prefix_discount
                    await asyncio.sleep(ttft)
                    self._prefix_store(prefix)
                    state.stats.prompt_tokens += n_in
                    if stream:
                        response = await self._stream(request, reply, rate)
                    else:
                        await asyncio.sleep(n_out / rate)
                        state.stats.generation_tokens += n_out
                        response = web.json_response(reply.whole())
                except asyncio.CancelledError:
                    # handler_cancellation: the client left (a hedge's loser, a gone caller)
                    state.stats.cancelled += 1
                    raise
                finally:
                    state.capacity.kv_used -= reserved
        except QueueFull:
            return _error(429, "queue is full", "rate_limit_error")
        state.stats.success += 1
        return response

    def _prefix_hit(self, prefix: bytes, n_in: int, chars: int) -> bool:
        stats = self.state.stats
        stats.prefix_queries += 1
        stats.prefix_query_tokens += n_in
        cache = self.state.prefixes
        if prefix not in cache:
            return False
        cache.move_to_end(prefix)
        stats.prefix_hits += 1
        stats.prefix_hit_tokens += min(n_in, math.ceil(chars / 4))
        return True

    def _prefix_store(self, prefix: bytes) -> None:
        limit = self.cfg.prefix_cache_entries
        if limit == 0:
            return
        cache = self.state.prefixes
        cache[prefix] = None
        cache.move_to_end(prefix)
        while len(cache) > limit:
            cache.popitem(last=False)

    async def _stream(self, request: web.Request, reply: _Reply, rate: float) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        # One event per interval carrying the tokens due by then: the pace is the configured rate,
        # and 500 streams cost a few thousand writes a second, not tens of thousands.
        per_event = max(1, round(rate * self.cfg.stream_interval_ms / 1000))
        start = loop.time()
        if reply.chat:
            await response.write(reply.event({"role": "assistant", "content": ""}, None))
        sent = 0
        while sent < reply.n_out:
            count = min(per_event, reply.n_out - sent)
            due = start + (sent + count) / rate
            await asyncio.sleep(max(0.0, due - loop.time()))
            await response.write(reply.event(_words(sent, count), None))
            sent += count
            self.state.stats.generation_tokens += count
        await response.write(reply.event("", "length"))
        if (reply.body.get("stream_options") or {}).get("include_usage"):
            await response.write(reply.usage_event())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._admit(request)
        if isinstance(body, web.Response):
            return body
        raw = body.get("input")
        if isinstance(raw, str):
            inputs: list[Any] = [raw]
        elif isinstance(raw, list) and raw:
            inputs = raw if not all(isinstance(v, int) for v in raw) else [raw]
        else:
            return _error(
                400, "`input` must be a string or a non-empty list", "invalid_request_error"
            )
        cfg = self.cfg
        try:
            async with self.state.capacity.slot():
                # One forward pass for the whole batch, as a real engine does.
                await asyncio.sleep(cfg.ttft_ms / 1000 * self.state.faults.slow_factor)
        except QueueFull:
            return _error(429, "queue is full", "rate_limit_error")
        n_in = sum(_estimate_tokens(v) for v in inputs)
        self.state.stats.prompt_tokens += n_in
        self.state.stats.success += 1
        data = [
            {"object": "embedding", "index": i, "embedding": _vector(v, cfg.embedding_dim)}
            for i, v in enumerate(inputs)
        ]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": body.get("model", cfg.models[0]),
                "usage": {"prompt_tokens": n_in, "total_tokens": n_in},
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "promptlb-emulator"}
            for m in self.cfg.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        if time.monotonic() < self.state.ready_at:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def stats(self, request: web.Request) -> web.Response:
        """``GET /_emulator/stats``: what the node did, for tests that check upstream effects."""
        return web.json_response(self.state.stats.as_dict())

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.state.faults.as_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        """``POST /_emulator/faults`` with any of ``slow_factor`` (> 0), ``hang`` (bool),
        ``leak_mb_per_req`` (>= 0), ``error_rate`` (0..1) and ``free_leaked`` (true drops the
        memory leaked so far). All are checked before any applies; answers the new state."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        problem = _check_faults(body)
        if problem:
            return _error(400, problem, "invalid_request_error")
        faults = self.state.faults
        if "slow_factor" in body:
            faults.slow_factor = float(body["slow_factor"])
        if "leak_mb_per_req" in body:
            faults.leak_mb_per_req = float(body["leak_mb_per_req"])
        if "error_rate" in body:
            faults.error_rate = float(body["error_rate"])
        if body.get("free_leaked"):
            self.state.stats.leaked.clear()
        if "hang" in body:
            if body["hang"]:
                faults.running.clear()
            else:
                faults.running.set()
        log.warning("faults now %s", faults.as_dict())
        return web.json_response(faults.as_dict())

    async def metrics(self, request: web.Request) -> web.Response:
        registry: CollectorRegistry = request.app[REGISTRY]
        return web.Response(
            body=generate_latest(registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _check_faults(body: dict[str, Any]) -> str | None:
    """What is wrong with a faults update, or None."""
    known = ("slow_factor", "hang", "leak_mb_per_req", "error_rate", "free_leaked")
    for key in body:
        if key not in known:
            return f"unknown key `{key}`; expected some of {', '.join(known)}"
    for key in ("hang", "free_leaked"):
        if key in body and not isinstance(body[key], bool):
            return f"`{key}` must be true or false"
    if "slow_factor" in body:
        value = _number(body["slow_factor"])
        if value is None or value <= 0:
            return "`slow_factor` must be a number > 0"
    if "leak_mb_per_req" in body:
        value = _number(body["leak_mb_per_req"])
        if value is None or value < 0:
            return "`leak_mb_per_req` must be a number >= 0"
    if "error_rate" in body:
        value = _number(body["error_rate"])
        if value is None or not 0 <= value <= 1:
            return "`error_rate` must be a probability in 0..1"
    return None


def _vector(value: object, dim: int) -> list[float]:
    """A deterministic unit vector per input, so equal inputs embed equally."""
    digest = b""
    seed = json.dumps(value, sort_keys=True).encode()
    while len(digest) < dim * 4:
        seed = hashlib.sha256(seed).digest()
        digest += seed
    ints = struct.unpack(f"<{dim}I", digest[: dim * 4])
    vec = [i / 2**31 - 1.0 for i in ints]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


@dataclass(slots=True)
class _Reply:
    chat: bool
    model: str
    n_in: int
    n_out: int
    body: dict[str, Any]
    id: str = field(default_factory=lambda: "cmpl-" + uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.n_in,
            "completion_tokens": self.n_out,
            "total_tokens": self.n_in + self.n_out,
        }

    def whole(self) -> dict[str, Any]:
        text = _words(0, self.n_out)
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": text},
            }
        else:
            choice = {"index": 0, "finish_reason": "length", "text": text}
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(),
        }

    def event(self, content: str | dict[str, str], finish: str | None) -> bytes:
        if self.chat:
            delta = (
                content if isinstance(content, dict) else ({"content": content} if content else {})
            )
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": content, "finish_reason": finish}
            kind = "text_completion"
        chunk = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def usage_event(self) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self._usage(),
        }
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


REGISTRY = web.AppKey("promptlb_emulator_registry", CollectorRegistry)


def create_app(config: EmulatorConfig) -> web.Application:
    """The emulator as an aiohttp app; serve it with ``AppRunner(app, handler_cancellation=True)``
    so that a client that goes away frees its slot, as it would on a real engine."""
    state = _State(
        config=config,
        capacity=Capacity(config.slots, config.max_queue),
        rng=random.Random(config.seed),
        ready_at=time.monotonic() + config.load_time_s,
        faults=_Faults(
            slow_factor=config.slow_factor,
            leak_mb_per_req=config.leak_mb_per_req,
            error_rate=config.error_rate,
        ),
    )
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_VllmMetrics(state))
    app = web.Application(client_max_size=8 * _MiB)
    app[STATE] = state
    app[REGISTRY] = registry
    handlers = _Handlers(state)
    app.router.add_post("/v1/chat/completions", handlers.chat)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/embeddings", handlers.embeddings)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/_emulator/faults", handlers.get_faults)
    app.router.add_get("/_emulator/stats", handlers.stats)
    app.router.add_post("/_emulator/faults", handlers.set_faults)
    return app
