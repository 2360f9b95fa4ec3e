"""The emulated model server: OpenAI-compatible endpoints over the capacity model. The request
handlers and the app; the prompt's reading, the answers, the faults and the metrics are their
own modules."""
# Over 350 lines: the handlers share one request's admission, faults, cache and streaming;
# what they call is in the modules named above.

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from promptlb.shared import BLOCK_TOKENS

from ._capacity import Capacity, QueueFull
from ._config import EmulatorConfig
from ._faults import Faults, check_faults, holds, leak
from ._forecast import Forecast
from ._kv import KVCache, prefilled
from ._metrics import Stats, VllmMetrics
from ._prompt import embedding_inputs, estimate_tokens, generation_prompt, prompt_blocks
from ._reply import Reply, vector, words

__all__ = ["create_app"]

log = logging.getLogger("promptlb.emulator")

_MiB = 1024 * 1024


@dataclass(slots=True)
class _State:
    config: EmulatorConfig
    capacity: Capacity
    rng: random.Random
    ready_at: float
    faults: Faults
    stats: Stats
    kv: KVCache
    forecast: Forecast

    def hung_after(self, requests: int) -> bool:
        """Whether request number ``requests`` waits for good under --hang-after."""
        after = self.config.hang_after
        return bool(after) and requests > after


STATE = web.AppKey("promptlb_emulator_state", _State)


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


async def _json_object(request: web.Request) -> dict[str, Any] | web.Response:
    """The request's JSON object, or the 400 that says why there is none."""
    try:
        body = await request.json()
    except (ValueError, RecursionError, LookupError):
        # (LookupError: a charset in the content type that Python does not know; ValueError
        # beyond JSONDecodeError: an integer past Python's 4,300 digits; RecursionError: a
        # deeply nested body. Each escaped as a plain-text 500, which a gateway charges to
        # the node.)
        return _error(400, "request body is not valid JSON", "invalid_request_error")
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object", "invalid_request_error")
    return body


_MAX_N = 128  # vLLM's own default limit on n
_MAX_CHOICES = 1024  # a batch's prompts times n


def _asked_tokens(body: dict[str, Any], chat: bool = True) -> int | None:
    """The answer's length the request asks for, when it asks a usable one: as vLLM reads
    it (``max_completion_tokens or max_tokens`` for a chat; a completion has ``max_tokens``
    alone), and the router too."""
    for key in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        asked = body.get(key)
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
            return asked
    return None


def _bad_length(
    body: dict[str, Any], n_in: int, n_out: int, limit: int, chat: bool = True
) -> web.Response | None:
    """vLLM's 400s for the answer's length: one asked that is no whole number of at least one
    (0 was served 64 tokens), and a prompt and answer past the context, here the KV cache's
    tokens (vLLM's context is never longer than its cache): an answer of 10^9 tokens took its
    scratch out of the cache and emptied every cached prefix."""
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        asked = body.get(key)  # (a completion's max_completion_tokens is ignored, as vLLM)
        if asked is None:
            continue
        if isinstance(asked, bool) or not isinstance(asked, int):
            return _error(400, f"{key} must be an integer, got {asked!r}.", "invalid_request_error")
        if asked < 1:
            return _error(400, f"{key} must be at least 1, got {asked!r}.", "invalid_request_error")
    if n_in + n_out > limit:
        message = (
            f"This model's maximum context length is {limit} tokens. However, you requested"
            f" {n_in + n_out} tokens ({n_in} in the messages, {n_out} in the completion)."
        )
        return _error(400, message, "invalid_request_error")
    return None


def _too_big(choices: int, tokens: int, limit: int) -> web.Response | None:
    """A request of several choices (a batch, an ``n``) whose prompts and answers together
    take more than the KV cache holds (one choice is held to the context already)."""
    if choices > 1 and tokens > limit:
        message = (
            f"The request's {choices} choices and their prompts take {tokens} tokens, more than"
            f" this model's KV cache of {limit} tokens; ask fewer at once."
        )
        return _error(400, message, "invalid_request_error")
    return None


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
        if state.hung_after(seen):
            await asyncio.get_running_loop().create_future()  # until the client gives up
        await state.faults.running.wait()  # a runtime hang: until it is lifted or the client goes
        poison = state.faults.poison
        if poison and holds(await request.read(), poison):
            # Where a server fails on it: once loaded and running (a hung node answered it at
            # once, a loading one 500 for 503), and counted as the node's error.
            state.stats.errors += 1
            return _error(500, "emulated crash on a poison request", "internal_server_error")
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        model = body.get("model") or cfg.models[0]  # null or "": the served model, as vLLM's
        if model not in cfg.models:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        faults = state.faults
        if faults.error_rate and state.rng.random() < faults.error_rate:
            state.stats.errors += 1
            return _error(500, "emulated internal error", "internal_server_error")
        if faults.leak_mb_per_req:
            # In a thread: the page faults of a large leak (half a second for 1 GB) stalled
            # every stream on the node, latency the fault is not meant to add. A leak still
            # being made when `free_leaked` came is let go too (kept, it outlived the reset).
            frees = state.stats.frees
            leaked = await asyncio.to_thread(leak, faults.leak_mb_per_req)
            if leaked is None:
                # A server out of memory fails its requests (were the kernel's OOM killer not
                # faster); the mapping's OSError was a plain-text 500.
                state.stats.errors += 1
                return _error(500, "out of memory", "internal_server_error")
            if state.stats.frees == frees:
                state.stats.leaked.append(leaked)
            else:
                leaked.close()
        return body

    def _output_tokens(self, body: dict[str, Any], chat: bool) -> int:
        asked = _asked_tokens(body, chat)
        if asked is not None:
            return asked
        cfg = self.cfg
        if cfg.output_spread <= 0:
            return cfg.output_tokens
        mu = math.log(cfg.output_tokens) - cfg.output_spread**2 / 2  # keeps the mean
        return max(1, round(self.state.rng.lognormvariate(mu, cfg.output_spread)))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(self._generate(request, chat=True))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(self._generate(request, chat=False))

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(self._embed(request))

    async def _counted(self, work: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """``work``, and a client that leaves counted ``cancelled`` wherever it waited: in a
        slot, in the queue for one, or held by a hang (only the first was counted, and a
        hedge's loser that queued went unseen)."""
        try:
            return await work
        except asyncio.CancelledError:  # handler_cancellation: the client left
            self.state.stats.cancelled += 1
            raise

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._admit(request)
        if isinstance(body, web.Response):
            return body
        prompt = body.get("messages") if chat else body.get("prompt")
        if prompt is None:
            field_name = "messages" if chat else "prompt"
            return _error(400, f"`{field_name}` is required", "invalid_request_error")
        read = generation_prompt(prompt, chat=chat)
        if isinstance(read, str):
            return _error(400, read, "invalid_request_error")
        cfg, state = self.cfg, self.state
        counts, blocks = read
        n = body.get("n", 1)
        if n is None:
            n = 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= _MAX_N:
            return _error(400, f"`n` must be an integer in 1..{_MAX_N}", "invalid_request_error")
        # A batch's prompts are each answered n times, choice index prompt * n + j (as vLLM);
        # bounded, as a batch of 10,000 one-letter prompts at n = 128 was an 80 MB answer.
        choices = n * len(counts)
        if choices > _MAX_CHOICES:
            message = f"{len(counts)} prompts x n = {n} is more than {_MAX_CHOICES} choices"
            return _error(400, message, "invalid_request_error")
        n_in, longest = sum(counts), max(counts)
        limit = cfg.context_tokens
        n_out = self._output_tokens(body, chat)
        if _asked_tokens(body, chat) is None:  # not asked: at most what the context leaves
            n_out = max(1, min(n_out, limit - longest, (limit - n_in) // choices))
        # The context bounds each prompt; and, as the emulator runs a request in one slot, its
        # prompts and every choice's answer together are bound by its KV cache (200 prompts of
        # 100 tokens, or n = 128 answers of 1,000, each within the context, took the whole
        # cache and emptied it).
        refused = _bad_length(body, longest, n_out, limit, chat) or _too_big(
            choices, n_in + choices * n_out, limit
        )
        if refused is not None:
            return refused
        slow = state.faults.slow_factor  # read once: a change applies to requests that start after
        rate = cfg.tokens_per_s / slow
        model = body.get("model") or cfg.models[0]
        stream = body.get("stream") is True
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            # Checked now: once the stream has started, a 200 is already on the wire.
            return _error(400, "`stream_options` must be an object", "invalid_request_error")
        finish = "length" if _asked_tokens(body, chat) is not None else "stop"
        reply = Reply(
            chat=chat, model=model, n_in=n_in, n_out=n_out, body=body, finish=finish, n=choices
        )
        forecast, token = state.forecast, object()
        forecast.queued(token, self._service(n_in, self._cached(blocks, n_in), n_out, slow))
        try:
            async with state.capacity.slot():
                # Looked up when prefill starts (the slot is ours): the blocks are then held
                # until the answer is done, and stay cached after it.
                lease = state.kv.start(blocks, n_in, n_out * choices)
                state.stats.looked_up(n_in, lease.cached_tokens)
                ttft = self._head(n_in, lease.cached_tokens, slow)
                began = time.monotonic()
                forecast.started(token, began + ttft + n_out / rate)
                done = 0.0  # of the prefill, for what the cache keeps should it be left now
                try:
                    await asyncio.sleep(ttft)
                    done = 1.0
                    state.stats.prompt_tokens += n_in
                    if stream:
                        response = await self._stream(request, reply, rate)
                    else:
                        async for _ in self._decode(n_out, rate, choices):
                            pass  # counted as they decode: a sidecar reads tokens/s off it
                        response = web.json_response(reply.whole())
                finally:
                    if done < 1.0:
                        fixed = cfg.ttft_ms / 1000 * slow
                        done = prefilled(time.monotonic() - began, fixed, ttft - fixed)
                    state.kv.finish(lease, done)
        except QueueFull:
            return _error(429, "queue is full", "rate_limit_error")
        finally:
            forecast.done(token)
        state.stats.success += 1
        return response

    def _cached(self, blocks: list[int], n_in: int) -> int:
        """The prompt tokens the cache holds now."""
        return min(n_in, self.state.kv.cached_prefix(blocks) * BLOCK_TOKENS)

    def _head(self, n_in: int, cached: int, slow: float) -> float:
        """Seconds to the first token: the fixed part, then the prefill of what is not cached."""
        cfg = self.cfg
        prefill = (n_in - cached) / cfg.prefill_tokens_per_s if cfg.prefill_tokens_per_s else 0.0
        return (cfg.ttft_ms / 1000 + prefill) * slow

    def _service(self, n_in: int, cached: int, n_out: int, slow: float) -> float:
        """Seconds in a slot: the first token, then the answer."""
        return self._head(n_in, cached, slow) + n_out / self.cfg.tokens_per_s * slow

    async def oracle(self, request: web.Request) -> web.Response:
        """``POST /_emulator/oracle`` with a request's body: what it would cost here now, for
        the bench's oracle router: ``wait_s`` before a slot (by the true queue), ``service_s``
        in it (by the true cache), and the prompt tokens cached of all."""
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        state = self.state
        hung = state.faults.hang or state.hung_after(state.stats.requests + 1)  # the next one
        if hung or time.monotonic() < state.ready_at:
            # Hung (at runtime, or by --hang-after: the next request would wait for good) or
            # still loading, it would not answer: no candidate, as the simulator's oracle drops
            # a hung node (it answered a wait of 0, held requests being outside the forecast,
            # and drew every request to itself).
            return _error(503, "hung" if hung else "model is loading", "service_unavailable")
        # The endpoint as the asker passes it (?chat=1 or 0); else the field the body has.
        asked = request.query.get("chat")
        chat = asked == "1" if asked in ("0", "1") else isinstance(body.get("messages"), list)
        prompt = body.get("messages" if chat else "prompt", "")
        read = generation_prompt(prompt, chat=chat)
        if isinstance(read, str):  # refused when sent: costed as before, the refusal is quick
            n_in, blocks = prompt_blocks(prompt, chat=chat)
        else:
            n_in, blocks = sum(read[0]), read[1]
        n_out = _asked_tokens(body, chat) or self.cfg.output_tokens  # the mean when not asked
        cached = self._cached(blocks, n_in)
        return web.json_response(
            {
                "wait_s": self.state.forecast.wait(time.monotonic()),
                "service_s": self._service(n_in, cached, n_out, self.state.faults.slow_factor),
                "cached_tokens": cached,
                "prompt_tokens": n_in,
            }
        )

    async def _stream(self, request: web.Request, reply: Reply, rate: float) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        # n choices decode side by side, as vLLM's parallel sampling streams them: each step
        # an event per choice (the same words: the emulator's text is no sample).
        choices = range(reply.n)
        if reply.chat:
            for i in choices:
                await response.write(reply.event({"role": "assistant", "content": ""}, None, i))
        async for sent, count in self._decode(reply.n_out, rate, reply.n):
            for i in choices:
                await response.write(reply.event(words(sent, count), None, i))
        for i in choices:
            await response.write(reply.event("", reply.finish, i))
        if (reply.body.get("stream_options") or {}).get("include_usage"):
            await response.write(reply.usage_event())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _decode(
        self, n_out: int, rate: float, choices: int = 1
    ) -> AsyncIterator[tuple[int, int]]:
        """The answer's tokens as they are due, ``(before, count)`` a step, each step counted in
        vLLM's generation counter then, as vLLM counts every decode step (a non-streamed
        answer's tokens all at its end made a sidecar's tokens/s read 0, then a spike).

        One step per interval carrying the tokens due by then: the pace is the configured rate,
        and 500 streams cost a few thousand writes a second, not tens of thousands. The first
        token alone, as prefill ends, as an engine sends it (and as the simulator times it):
        held for the first step's interval, every time to first token read one interval late
        (50 ms at the prefix scenarios' 40 tokens/s). The rest keep their pace, the last due
        where it was."""
        loop = asyncio.get_running_loop()
        per_event = max(1, round(rate * self.cfg.stream_interval_ms / 1000))
        start = loop.time()
        sent = 0
        while sent < n_out:
            count = min(per_event, n_out - sent) if sent else 1
            due = start + (sent + count) / rate if sent else start
            await asyncio.sleep(max(0.0, due - loop.time()))
            yield sent, count
            sent += count
            self.state.stats.generation_tokens += count * choices  # n choices decode alike

    async def _embed(self, request: web.Request) -> web.StreamResponse:
        body = await self._admit(request)
        if isinstance(body, web.Response):
            return body
        inputs = embedding_inputs(body.get("input"))
        if inputs is None:
            return _error(
                400,
                "`input` must be a string, a token array, or a non-empty list of either",
                "invalid_request_error",
            )
        cfg, state = self.cfg, self.state
        service = cfg.ttft_ms / 1000 * state.faults.slow_factor
        # In the forecast too: slots busy with embeddings told the live oracle a wait of 0.
        forecast, token = state.forecast, object()
        forecast.queued(token, service)
        try:
            async with state.capacity.slot():
                forecast.started(token, time.monotonic() + service)
                # One forward pass for the whole batch, as a real engine does.
                await asyncio.sleep(service)
        except QueueFull:
            return _error(429, "queue is full", "rate_limit_error")
        finally:
            forecast.done(token)
        n_in = sum(estimate_tokens(v) for v in inputs)
        self.state.stats.prompt_tokens += n_in
        self.state.stats.success += 1
        data = [
            {"object": "embedding", "index": i, "embedding": vector(v, cfg.embedding_dim)}
            for i, v in enumerate(inputs)
        ]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": body.get("model") or cfg.models[0],
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
        """``GET /_emulator/stats``: what the node did, for tests that check upstream effects,
        and how full its prefix cache is (``kv_filled``, 0..1), which its /metrics cannot say."""
        return web.json_response({**self.state.stats.as_dict(), "kv_filled": self.state.kv.filled})

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.state.faults.as_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        """``POST /_emulator/faults`` with any of ``slow_factor`` (1e-3..1e6), ``hang`` (bool),
        ``leak_mb_per_req`` (0..1024), ``error_rate`` (0..1) and ``free_leaked`` (true drops the
        memory leaked so far). All are checked before any applies; answers the new state."""
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        problem = check_faults(body)
        if problem:
            return _error(400, problem, "invalid_request_error")
        faults = self.state.faults
        faults.update(body)
        if body.get("free_leaked"):
            self.state.stats.frees += 1
            leaked = self.state.stats.leaked
            for leak in leaked:
                leak.close()  # unmapped: the RSS goes at once
            leaked.clear()
        log.warning("faults now %s", faults.as_dict())
        return web.json_response(faults.as_dict())

    async def metrics(self, request: web.Request) -> web.Response:
        registry: CollectorRegistry = request.app[REGISTRY]
        return web.Response(
            body=generate_latest(registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


REGISTRY = web.AppKey("promptlb_emulator_registry", CollectorRegistry)


def create_app(config: EmulatorConfig) -> web.Application:
    """The emulator as an aiohttp app; serve it with ``AppRunner(app, handler_cancellation=True)``
    so that a client that goes away frees its slot, as it would on a real engine."""
    stats = Stats()
    capacity = Capacity(config.slots, config.max_queue)
    kv = KVCache(config.kv_capacity)
    state = _State(
        config=config,
        capacity=capacity,
        rng=random.Random(config.seed),
        ready_at=time.monotonic() + config.load_time_s,
        faults=Faults(
            slow_factor=config.slow_factor,
            leak_mb_per_req=config.leak_mb_per_req,
            error_rate=config.error_rate,
        ),
        stats=stats,
        kv=kv,
        forecast=Forecast(config.slots),
    )
    registry = CollectorRegistry(auto_describe=True)
    registry.register(VllmMetrics(config, capacity, kv, stats))
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
    app.router.add_post("/_emulator/oracle", handlers.oracle)
    return app
