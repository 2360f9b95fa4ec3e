"""Talking to the model server: the readiness probe, model discovery and warmup."""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp

from ._config import WarmupEndpoint

__all__ = ["ProbeResult", "WarmupReport", "list_models", "probe", "warmup"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    reason: str = ""
    gone: bool = False  # nothing listens: the server died or restarts, so its warm state is lost


async def probe(session: aiohttp.ClientSession, base: str, timeout: float) -> ProbeResult:
    """``GET /health``; a server without one (404/405) is asked ``GET /v1/models`` instead."""
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    for path in ("/health", "/v1/models"):
        try:
            async with session.get(base + path, timeout=client_timeout) as response:
                await response.read()
                if response.status in (404, 405) and path == "/health":
                    continue
                if 200 <= response.status < 300:
                    return ProbeResult(True)
                return ProbeResult(False, f"model server {path} answered {response.status}")
        except aiohttp.ClientConnectorError as exc:
            # Gone only when refused: nothing listens, so its warm state is lost. A failed DNS
            # lookup or an unreachable route says nothing of the server, and waits out
            # `unhealthy_after` like a timeout (a CoreDNS blip made the node cold at once).
            refused = isinstance(exc.os_error, ConnectionRefusedError)
            return ProbeResult(False, f"model server unreachable: {exc.os_error}", gone=refused)
        except TimeoutError:
            return ProbeResult(False, f"model server {path} timed out after {timeout:g}s")
        except aiohttp.ClientError as exc:
            return ProbeResult(False, f"model server {path} failed: {type(exc).__name__}: {exc}")
    return ProbeResult(False, "model server has neither /health nor /v1/models")


async def list_models(session: aiohttp.ClientSession, base: str, timeout: float) -> list[str]:
    try:
        async with session.get(
            base + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            if response.status != 200:
                return []
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError, RecursionError):
        # RecursionError: JSON nested past the parser's depth is no list of models either.
        return []
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


@dataclass(frozen=True, slots=True)
class WarmupReport:
    ok: bool
    durations_s: tuple[float, ...]
    error: str = ""
    finished_at: float = 0.0

    def as_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "durations_ms": [round(d * 1000, 1) for d in self.durations_s],
            "error": self.error or None,
            "finished_at": self.finished_at,
        }


_WARMUP_PATHS: dict[WarmupEndpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}


async def warmup(
    session: aiohttp.ClientSession,
    base: str,
    *,
    model: str,
    prompts: tuple[str, ...],
    max_tokens: int,
    timeout: float,
    endpoint: WarmupEndpoint = "chat",
) -> WarmupReport:
    """Send each warmup prompt through the OpenAI ``endpoint`` API, in order, timing each."""
    durations: list[float] = []
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    path = _WARMUP_PATHS[endpoint]
    for prompt in prompts:
        body: dict[str, object] = {"model": model}
        if endpoint == "chat":
            body |= {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        elif endpoint == "completions":
            body |= {"prompt": prompt, "max_tokens": max_tokens}
        else:
            body["input"] = prompt
        start = time.perf_counter()
        try:
            async with session.post(base + path, json=body, timeout=client_timeout) as response:
                await response.read()
                if response.status != 200:
                    return WarmupReport(
                        False,
                        tuple(durations),
                        f"warmup prompt answered {response.status}",
                        time.time(),
                    )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return WarmupReport(
                False,
                tuple(durations),
                f"warmup prompt failed: {type(exc).__name__}: {exc}",
                time.time(),
            )
        durations.append(time.perf_counter() - start)
    return WarmupReport(True, tuple(durations), "", time.time())
