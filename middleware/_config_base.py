"""Validation helpers shared by the configuration modules."""

from __future__ import annotations

import math
from urllib.parse import parse_qs, urlsplit

from promptlb.shared import ConfigError
from promptlb.shared._config import redact_url, url_detail

__all__ = [
    "DURATION",
    "MODEL_CHARS",
    "check_model",
    "check_redis_url",
    "check_url",
    "positive",
    "redact_url",
    "whole_number",
]

DURATION = {"duration": True}  # field metadata: accepts "250ms", "5s" or seconds


def check_url(key: str, value: str) -> str:
    """A node's base URL, without its trailing slash: the routes (``/v1/...``) and the sidecar's
    paths are appended to it as they are."""
    expected = "an http(s) URL such as http://10.0.0.1:8000"
    try:
        parts = urlsplit(value)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        raise ConfigError(key, value, expected) from None
    if parts.username is not None or parts.password is not None:
        # Sent as basic auth, and printed wherever the URL is (health logs, the status page).
        raise ConfigError(key, redact_url(value), "a URL without user:password@ (use api_key)")
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or any(c.isspace() for c in parts.netloc)
    ):
        raise ConfigError(key, value, expected)
    try:
        # As aiohttp will connect to it: an empty label (a..b) or one over 63 characters raised
        # UnicodeError out of every poll, which stopped the gateway starting (or a reload).
        parts.hostname.encode("idna")
    except UnicodeError:
        raise ConfigError(key, value, f"{expected}, its host name's labels 1-63 long") from None
    try:
        port = parts.port  # parsed on access: out of range or not a number raises
    except ValueError:
        port = 0
    if port == 0:  # nothing listens there: the node would never turn healthy
        raise ConfigError(key, value, f"{expected}, its port in 1..65535")
    # The request's own path is appended: http://h:8000/v1 would get /v1/v1/chat/completions.
    if parts.path not in ("", "/") or "?" in value or "#" in value:
        raise ConfigError(
            key, value, "a base URL such as http://10.0.0.1:8000 (no path like /v1, no query)"
        )
    return value.rstrip("/")


# Query options of a Redis URL that promptlb sets itself, and the values that agree with it.
_REDIS_OWN: dict[str, frozenset[str]] = {
    "protocol": frozenset({"2"}),
    # redis-py passes its value on unparsed: "false" is a true string, and decodes.
    "decode_responses": frozenset(),
    "socket_timeout": frozenset(),
    "socket_connect_timeout": frozenset(),
}


def check_redis_url(key: str, value: str, expected: str) -> None:
    """A Redis URL that redis-py will take: checked now, or the gateway would fail on it as it
    starts, or halfway through applying a reloaded config."""
    shown = redact_url(value)  # the error is printed and logged: the password stays out
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(key, shown, expected)
    try:
        options = parse_qs(urlsplit(value).query, keep_blank_values=True)
    except ValueError:  # an unclosed [ : refused with redis-py's reason below
        options = {}
    for option, allowed in _REDIS_OWN.items():
        if option in options and any(v.lower() not in allowed for v in options[option]):
            # The URL's options override the client's arguments: RESP3 or decoded replies
            # broke every round of the index share (a traceback, then nothing learnt from the
            # other replicas), and a socket timeout of its own replaced the configured one.
            raise ConfigError(key, shown, f"{expected}, without {option} in its query")
    try:
        from redis.asyncio.connection import ConnectionPool  # what Redis.from_url builds
    except ImportError:
        # Refused here, as a config error: at start a clear message, at a reload a refusal
        # (it was a ModuleNotFoundError out of reload(), or out of a half-applied one).
        raise ConfigError(key, shown, f"{expected}, with promptlb[redis] installed") from None
    try:
        # A connection built, not opened: an option in the query string that the connection
        # does not take (ssl_cert_reqs on redis://, a typo) passes the parse and raised a
        # TypeError from every cache call, each a 500.
        ConnectionPool.from_url(value).make_connection()  # type: ignore[no-untyped-call]
    except ValueError as exc:
        why = url_detail(value, str(exc).rstrip("."))
        raise ConfigError(key, shown, f"{expected}{why}") from None
    except TypeError as exc:  # names the option, never a value
        raise ConfigError(key, shown, f"{expected} ({exc})") from None


def check_header_name(key: str, value: object) -> None:
    """An HTTP header name (a token): anything else could never match a request's header."""
    if (
        not isinstance(value, str)
        or not value.strip()
        or not all(33 <= ord(c) < 127 and c not in ':"(),/;<=>?@[\\]{}' for c in value)
    ):
        raise ConfigError(key, value, "an HTTP header name such as x-session-id")


MODEL_CHARS = 256  # a model name's length at most, in a request or the config


def check_model(key: str, value: object) -> None:
    """A model name as a request may carry it: it is sent in the ``x-promptlb-model`` header,
    where a control character made the server refuse every answer of that model (charged
    to a healthy node)."""
    if not isinstance(value, str) or not 0 < len(value) <= MODEL_CHARS or not value.isprintable():
        raise ConfigError(key, value, f"a model name: printable text of 1..{MODEL_CHARS}")


def positive(key: str, value: float, *, zero: bool = False, most: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(key, value, "a finite number")
    if value < 0 or (value == 0 and not zero):
        raise ConfigError(key, value, ">= 0" if zero else "> 0")
    if most is not None and value > most:
        raise ConfigError(key, value, f"at most {most:g}")


def whole_number(key: str, value: object, low: int) -> int:
    # bool is an int subclass, and `true` where a count belongs is a config mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(key, value, f"an integer >= {low}")
    return value
