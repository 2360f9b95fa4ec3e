"""The sidecar's settings: one typed, keyword-only object; the CLI only forwards to it."""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field, fields
from typing import Literal
from urllib.parse import urlsplit

from promptlb.shared import ConfigError, SigningKey, SnapshotError
from promptlb.shared._config import url_detail
from promptlb.shared._snapshot import (
    MAX_COUNT,
    MAX_NAME_CHARS,
    MAX_NAMES,
    MAX_SNAPSHOT_BYTES,
    Snapshot,
    encode_unsigned,
)

__all__ = [
    "MIN_TOKEN_CHARS",
    "MODEL_KEY_RULE",
    "WARMUP_ENDPOINTS",
    "EngineChoice",
    "SidecarConfig",
    "WarmupEndpoint",
    "valid_model_key",
]

WarmupEndpoint = Literal["chat", "completions", "embeddings"]
WARMUP_ENDPOINTS: tuple[WarmupEndpoint, ...] = ("chat", "completions", "embeddings")

MIN_TOKEN_CHARS = 8
# What a snapshot holds besides the configured names, at most: 64 GPUs, the engine, memory
# and the signature.
_SNAPSHOT_ROOM = 8 * 1024

EngineChoice = Literal["auto", "vllm", "tgi", "llamacpp", "sglang", "none"]
_ENGINES = ("auto", "vllm", "tgi", "llamacpp", "sglang", "none")


MODEL_KEY_RULE = "a key of printable characters on one line"


def valid_model_key(key: str) -> bool:
    """Whether ``key`` can go in an Authorization header as it is."""
    return bool(key) and key == key.strip() and key.isprintable()


def _whole(key: str, value: object, lo: int, hi: int | None, expected: str) -> None:
    """An integer (not a bool) in ``lo..hi`` (``hi`` None: no bound), or ``expected``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < lo
        or (hi is not None and value > hi)
    ):
        raise ConfigError(key, value, expected)


def _seconds(key: str, value: float, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(key, value, "a number of seconds")
    if not lo <= value <= hi:
        raise ConfigError(key, value, f"between {lo:g}s and {hi:g}s")


@dataclass(frozen=True, slots=True, kw_only=True)
class SidecarConfig:
    """A sidecar beside one model server.

    ``token`` guards the control endpoints (POSTs; GETs too with ``protect_reads``). Without a
    token the control endpoints answer 403: drain and warmup are never open to anyone who can
    reach the port.
    """

    model_url: str = "http://127.0.0.1:8000"
    engine: EngineChoice = "auto"
    host: str = "127.0.0.1"
    port: int = 9500
    node_name: str = field(default_factory=socket.gethostname)
    models: tuple[str, ...] = ()  # empty: taken from the model server's /v1/models
    tags: tuple[str, ...] = ()
    tier: str = ""
    token: str | None = field(default=None, repr=False)
    # What the model server asks of its callers (vLLM's --api-key): sent on every call to it,
    # or its /v1/models and the warmup answer 401 and the node never becomes ready.
    model_api_key: str | None = field(default=None, repr=False)
    sign_key: SigningKey | None = None
    protect_reads: bool = False
    # POSTs from this host only (the pod's own preStop hook, kubectl exec): a token shared by
    # every pod, read by one compromised pod, then drains that pod alone, not the fleet.
    local_control: bool = False
    warmup_prompts: tuple[str, ...] = ("Hello! Reply with one word.",)
    # The API the prompts go through: an embeddings server (TEI, vLLM --task embed) has no chat
    # route, and every warmup answered 404, so the node never became ready.
    warmup_endpoint: WarmupEndpoint = "chat"
    warmup_max_tokens: int = 8
    warmup_timeout_s: float = 60.0
    warmup_at_start: bool = True
    warmup_required: bool = True
    sample_interval_s: float = 0.25
    probe_timeout_s: float = 1.0
    # Probes failed in a row before the server is not ready: one late /health is a busy
    # server, not a sick one (a loaded vLLM answers late exactly when busiest). A server that
    # refuses connections is not ready at once.
    unhealthy_after: int = 2
    model_pid: int | None = None
    rss_window_s: float = 60.0
    # The model server's memory limit in bytes, for the time it has left before a leak kills it;
    # None: its cgroup's limit when it has one, else the host's available memory.
    memory_limit: int | None = None
    gpu: bool = True
    gpu_devices: tuple[str, ...] = ()  # by NVML index or UUID; empty: every GPU NVML sees

    def __post_init__(self) -> None:
        url_expected = "an http(s) URL such as http://127.0.0.1:8000"
        if not isinstance(self.model_url, str):
            raise ConfigError("model_url", self.model_url, url_expected)
        try:
            parts = urlsplit(self.model_url)
            _ = parts.port  # a port that is not a number in 0..65535 raises ValueError here
        except ValueError as exc:  # also an unclosed IPv6 bracket: http://[::1
            why = url_detail(self.model_url, str(exc))
            raise ConfigError("model_url", self.model_url, f"{url_expected}{why}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("model_url", self.model_url, url_expected)
        # Paths are appended to it (/health, /v1/models, /metrics): a query or fragment ended
        # up before them, and an OpenAI base URL's /v1 doubled (/v1/v1/models), so the node
        # never became ready, with only a 404 to say why.
        if "?" in self.model_url or "#" in self.model_url:  # an empty one too
            raise ConfigError("model_url", self.model_url, "a URL without a query or fragment")
        if parts.path.rstrip("/").endswith("/v1"):
            raise ConfigError(
                "model_url", self.model_url, "the server's root, without /v1 (added per route)"
            )
        object.__setattr__(self, "model_url", self.model_url.rstrip("/"))
        if self.engine not in _ENGINES:
            raise ConfigError("engine", self.engine, "one of " + ", ".join(_ENGINES))
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not (0 <= self.port <= 65535)
        ):
            raise ConfigError("port", self.port, "a TCP port in 0..65535")
        # A Python caller's string where names belong was taken letter by letter ("Hello" as
        # five warmup prompts), and a number where text belongs raised a bare TypeError.
        for key in ("models", "tags", "gpu_devices", "warmup_prompts"):
            value = getattr(self, key)
            if isinstance(value, str | bytes) or not isinstance(value, tuple | list):
                name = "warmup_prompt" if key == "warmup_prompts" else key  # as its flag
                raise ConfigError(name, value, "a tuple of strings")
            object.__setattr__(self, key, tuple(value))
        for key in ("node_name", "tier", "token", "model_api_key"):
            value = getattr(self, key)
            if not isinstance(value, str) and (value is not None or key in ("node_name", "tier")):
                shown = "<hidden>" if key in ("token", "model_api_key") else value
                raise ConfigError(key, shown, "a string")
        if not self.node_name or len(self.node_name) > 253:
            raise ConfigError("node_name", self.node_name, "1..253 characters")
        for key in ("models", "tags"):
            values = getattr(self, key)
            if len(values) > MAX_NAMES:
                raise ConfigError(key, values, f"at most {MAX_NAMES} names")
            if not all(isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS for v in values):
                raise ConfigError(key, values, f"names of 1..{MAX_NAME_CHARS} characters")
        if len(self.gpu_devices) > 64 or not all(
            isinstance(d, str) and 0 < len(d) <= 96 and d.isprintable() for d in self.gpu_devices
        ):
            raise ConfigError("gpu_devices", self.gpu_devices, "up to 64 GPU indices or UUIDs")
        if len(self.tier) > 128:
            raise ConfigError("tier", self.tier, "at most 128 characters")
        self._check_snapshot()
        if self.token is not None and len(self.token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                "token", "<hidden>", f"a token of at least {MIN_TOKEN_CHARS} characters"
            )
        if self.model_api_key is not None and not valid_model_key(self.model_api_key):
            raise ConfigError("model_api_key", "<hidden>", MODEL_KEY_RULE)
        if self.protect_reads and self.token is None:
            raise ConfigError(
                "protect_reads",
                True,
                "a token (--token-file or PROMPTLB_SIDECAR_TOKEN) to protect reads with",
            )
        if not self.warmup_prompts or not all(
            isinstance(p, str) and p for p in self.warmup_prompts
        ):
            raise ConfigError("warmup_prompt", self.warmup_prompts, "non-empty prompts")
        if self.warmup_endpoint not in WARMUP_ENDPOINTS:
            raise ConfigError(
                "warmup_endpoint", self.warmup_endpoint, " or ".join(WARMUP_ENDPOINTS)
            )
        _whole("warmup_max_tokens", self.warmup_max_tokens, 1, 4096, "1..4096")
        _seconds("sample_interval", self.sample_interval_s, 0.01, 60.0)
        _seconds("probe_timeout", self.probe_timeout_s, 0.01, 60.0)
        _whole("unhealthy_after", self.unhealthy_after, 1, 100, "an integer in 1..100")
        _seconds("warmup_timeout", self.warmup_timeout_s, 0.1, 3600.0)
        _seconds("rss_window", self.rss_window_s, 1.0, 86400.0)
        if self.rss_window_s < 2 * self.sample_interval_s:
            # Never two samples in the window: no slope, so no leak warning and no drain.
            raise ConfigError("rss_window", self.rss_window_s, "at least twice the sample interval")
        # Up to a snapshot's largest count (2**53 bytes, 8 PiB): a limit beyond it made every
        # snapshot's mem_free unencodable, and /snapshot failed on every request.
        if self.memory_limit is not None:
            expected = f"a number of bytes in 1..{MAX_COUNT}"
            _whole("memory_limit", self.memory_limit, 1, MAX_COUNT, expected)
        if self.model_pid is not None:
            _whole("model_pid", self.model_pid, 1, None, "a process id >= 1")

    def _check_snapshot(self) -> None:
        """The names as every snapshot will carry them: text that encodes as UTF-8 (argv's
        undecodable bytes do not) and that leaves room for the load in the size limit, checked
        here, where each made every /snapshot a 500."""
        for key in ("node_name", "tier", "models", "tags"):
            value = getattr(self, key)
            for text in value if isinstance(value, tuple) else (value,):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ConfigError(key, ascii(value), "UTF-8 text") from None
        size = self._names_size(self.models)
        limit = MAX_SNAPSHOT_BYTES - _SNAPSHOT_ROOM
        if size > limit:
            # The key at fault: the tags when they fill it without any model (the name and
            # the tier are too short to), else the models; it named the models either way.
            if self._names_size(()) > limit:
                raise ConfigError(
                    "tags", f"{size} bytes of names", f"names within {limit} bytes in all"
                )
            raise ConfigError(
                "models", f"{size} bytes of names", f"names within {limit} bytes, with the tags"
            )

    def _names_size(self, models: tuple[str, ...]) -> int:
        """Bytes of a snapshot carrying ``models`` and the configured names, and no load."""
        try:
            trial = Snapshot(
                node=self.node_name,
                boot="0" * 16,
                seq=1,
                ts=0.0,
                models=models,
                tags=self.tags,
                tier=self.tier,
            )
            return len(encode_unsigned(trial))
        except SnapshotError:
            return MAX_SNAPSHOT_BYTES

    @property
    def learnt_names_room(self) -> int:
        """UTF-8 bytes of model names learnt from the server that a snapshot has room for,
        beside the configured tags (each name costs its bytes and a 3-byte header at most)."""
        return max(0, MAX_SNAPSHOT_BYTES - _SNAPSHOT_ROOM - self._names_size(()))

    @property
    def model_host(self) -> str | None:
        return urlsplit(self.model_url).hostname

    @property
    def model_port(self) -> int:
        parts = urlsplit(self.model_url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        token = "<set>" if self.token else None
        key = "<set>" if self.model_api_key else None
        return f"SidecarConfig({shown}, token={token}, model_api_key={key})"
