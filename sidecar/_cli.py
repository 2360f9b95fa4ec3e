"""``promptlb-sidecar``: the command line only forwards to `SidecarConfig`."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from promptlb.shared import ConfigError, parse_duration
from promptlb.shared import load_key_file as _load_key_file
from promptlb.shared._serve import config_or_exit, serve
from promptlb.shared._snapshot import MAX_COUNT

from ._app import create_app
from ._config import (
    _ENGINES,
    MIN_TOKEN_CHARS,
    MODEL_KEY_RULE,
    WARMUP_ENDPOINTS,
    SidecarConfig,
    valid_model_key,
)

__all__ = ["main"]

TOKEN_ENV = "PROMPTLB_SIDECAR_TOKEN"
MODEL_KEY_ENV = "PROMPTLB_MODEL_API_KEY"
DEFAULT_WARMUP = SidecarConfig(node_name="-").warmup_prompts


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones and those of flags without a value: "(default: None)"
    or "(default: False)" says nothing that the help does not."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None or action.default in ("", ()):
            return action.help
        return super()._get_help_string(action)


def _names(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _parser() -> argparse.ArgumentParser:
    d = SidecarConfig(node_name="-")
    p = argparse.ArgumentParser(
        prog="promptlb-sidecar",
        description="Health, warmup, drain and load snapshots for one model server.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model-url", default=d.model_url, help="the model server's base URL")
    p.add_argument(
        "--engine",
        default=d.engine,
        choices=_ENGINES,
        help="which /metrics names to read; auto detects them; none skips",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    p.add_argument("--node-name", default=None, help="default: the host name")
    p.add_argument(
        "--models",
        type=_names,
        default=(),
        help="comma-separated; default: the model server's /v1/models",
    )
    p.add_argument("--tags", type=_names, default=(), help="comma-separated capabilities")
    p.add_argument("--tier", default="", help="e.g. heavy or light")
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help=f"bearer token for the control endpoints; or set {TOKEN_ENV}",
    )
    p.add_argument(
        "--protect-reads", action="store_true", help="require the token for the GET endpoints too"
    )
    p.add_argument(
        "--local-control",
        action="store_true",
        help="answer POST /warmup, /drain, /undrain from this host (loopback) only, token still"
        " required",
    )
    p.add_argument(
        "--model-api-key-file",
        type=Path,
        default=None,
        help=f"the key the model server asks for (vLLM's --api-key); or set {MODEL_KEY_ENV}",
    )
    p.add_argument(
        "--sign-key-file",
        type=Path,
        default=None,
        help="KID:SECRET on one line; snapshots are then HMAC-signed",
    )
    p.add_argument(
        "--warmup-prompt",
        action="append",
        default=None,
        help=f"a warmup prompt, sent in order (repeatable; default: {DEFAULT_WARMUP[0]!r})",
    )
    p.add_argument(
        "--warmup-endpoint",
        choices=WARMUP_ENDPOINTS,
        default=d.warmup_endpoint,
        help="the OpenAI API the warmup prompts go through (embeddings for an embedding server)",
    )
    p.add_argument(
        "--warmup-max-tokens",
        type=int,
        default=d.warmup_max_tokens,
        help="max_tokens of each warmup request (1..4096)",
    )
    p.add_argument(
        "--warmup-timeout",
        default=f"{d.warmup_timeout_s:g}s",
        help="limit on each warmup request, e.g. 60s or 2m",
    )
    p.add_argument("--no-warmup-at-start", action="store_true", help="warm up only on POST /warmup")
    p.add_argument(
        "--no-warmup-required",
        action="store_true",
        help="ready as soon as the model server answers",
    )
    p.add_argument("--sample-interval", default="250ms", help="e.g. 250ms or 1s")
    p.add_argument(
        "--probe-timeout",
        default=f"{d.probe_timeout_s:g}s",
        help="limit on each readiness probe, /v1/models and /metrics request",
    )
    p.add_argument(
        "--unhealthy-after",
        type=int,
        default=d.unhealthy_after,
        help="probes failed in a row before not ready (a refused connection: at once)",
    )
    p.add_argument(
        "--model-pid",
        type=int,
        default=None,
        help="model-server pid for RSS; default: whoever listens on its port",
    )
    p.add_argument("--rss-window", default="60s", help="window of the RSS slope")
    p.add_argument(
        "--memory-limit-mb",
        type=int,
        default=None,
        help="the model server's memory limit; default: its cgroup's, else the host's free memory",
    )
    p.add_argument("--no-gpu", action="store_true", help="do not read NVML")
    p.add_argument(
        "--gpu-devices",
        type=_names,
        default=(),
        help="comma-separated GPU indices or UUIDs this model server uses; default: every GPU",
    )
    # Either case, as the gateway's and the emulator's: one LOG_LEVEL shared by the
    # containers of a pod crash-looped the one that took the other case.
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )
    return p


def _memory_limit(megabytes: int | None) -> int | None:
    """``--memory-limit-mb`` in bytes; checked here, in the flag's own unit and name (the
    config's check would name a ``--memory-limit`` in bytes that there is no flag for)."""
    if megabytes is None:
        return None
    if not 1 <= megabytes <= MAX_COUNT >> 20:
        raise ConfigError("memory_limit_mb", megabytes, f"a number of MiB in 1..{MAX_COUNT >> 20}")
    return megabytes << 20


def _read_token(parser: argparse.ArgumentParser, path: Path | None) -> str | None:
    """The control endpoints' token, from ``--token-file`` or else the environment."""
    rule = f"a token of at least {MIN_TOKEN_CHARS} characters"

    def valid(token: str) -> bool:
        return len(token) >= MIN_TOKEN_CHARS

    return _read_secret(parser, path, env=TOKEN_ENV, key="token_file", valid=valid, rule=rule)


def _read_model_key(parser: argparse.ArgumentParser, path: Path | None) -> str | None:
    """The model server's API key, from ``--model-api-key-file`` or else the environment."""
    return _read_secret(
        parser,
        path,
        env=MODEL_KEY_ENV,
        key="model_api_key_file",
        valid=valid_model_key,
        rule=MODEL_KEY_RULE,
    )


def _read_secret(
    parser: argparse.ArgumentParser,
    path: Path | None,
    *,
    env: str,
    key: str,
    valid: Callable[[str], bool],
    rule: str,
) -> str | None:
    """A secret from the file, or else the environment variable ``env``, stripped (a Secret
    made from a file carries its trailing newline, and a token presented, stripped, never
    matched it); a bad one names where it came from, never what it holds."""
    if path is None:
        raw = os.environ.get(env) or None
        secret = None if raw is None else raw.strip()
        if secret is not None and not valid(secret):
            # Not an argument: argparse's "argument --flag" form would blame the wrong thing.
            parser.error(f"{env}: expected {rule}")
        return secret
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, str(path), f"a readable file ({exc})") from None
    if not valid(secret):
        raise ConfigError(key, str(path), f"a file holding {rule}")
    return secret


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")

    def build() -> SidecarConfig:
        sign_key = None
        if args.sign_key_file is not None:
            try:
                sign_key = _load_key_file(args.sign_key_file)
            except ValueError as exc:
                raise ConfigError("sign_key_file", str(args.sign_key_file), str(exc)) from None
        extra = {"node_name": args.node_name} if args.node_name else {}
        return SidecarConfig(
            model_url=args.model_url,
            engine=args.engine,
            host=args.host,
            port=args.port,
            models=args.models,
            tags=args.tags,
            tier=args.tier,
            token=_read_token(parser, args.token_file),
            model_api_key=_read_model_key(parser, args.model_api_key_file),
            protect_reads=args.protect_reads,
            local_control=args.local_control,
            sign_key=sign_key,
            warmup_prompts=tuple(args.warmup_prompt or DEFAULT_WARMUP),
            warmup_endpoint=args.warmup_endpoint,
            warmup_max_tokens=args.warmup_max_tokens,
            warmup_timeout_s=parse_duration("warmup_timeout", args.warmup_timeout),
            warmup_at_start=not args.no_warmup_at_start,
            warmup_required=not args.no_warmup_required,
            sample_interval_s=parse_duration("sample_interval", args.sample_interval),
            probe_timeout_s=parse_duration("probe_timeout", args.probe_timeout),
            unhealthy_after=args.unhealthy_after,
            model_pid=args.model_pid,
            rss_window_s=parse_duration("rss_window", args.rss_window),
            memory_limit=_memory_limit(args.memory_limit_mb),
            gpu=not args.no_gpu,
            gpu_devices=args.gpu_devices,
            **extra,
        )

    config = config_or_exit(parser, build)
    serve(create_app(config), config.host, config.port, "promptlb-sidecar")
