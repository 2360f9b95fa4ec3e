"""Helpers every config object uses, so that bad values fail the same clear way everywhere."""

from __future__ import annotations

import math
import re

__all__ = ["ConfigError", "Redacted", "parse_duration", "redact_url", "url_detail"]


class Redacted:
    """Stands in an error for a value it must not print: a secret, or what may be one (the
    value of a mistyped key such as ``admin_tokne``)."""

    __slots__ = ("kind",)

    def __init__(self, value: object) -> None:
        self.kind = type(value).__name__

    def __repr__(self) -> str:
        return f"<a {self.kind}, not shown>"


class ConfigError(ValueError):
    """A config value is wrong. ``key`` names it the way the user wrote it."""

    def __init__(self, key: str, value: object, expected: str) -> None:
        # A URL's password never reaches an error (the sidecar's --model-url printed one), nor
        # one in a list or a table (redis = ["redis://u:pw@h"]), nor in a URL typed without
        # its slashes (u:pw@h).
        value = _redacted(value)
        self.key = key
        self.value = value
        self.expected = expected
        super().__init__(f"{key}: got {value!r}, expected {expected}")


# ASCII digits only: \d took any script's (Arabic-Indic "12s" was 12 s).
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|µs|μs|ms|s|m|h)?\s*$", re.ASCII)
_MOST_S = 1e10  # some 300 years: past it no duration is meant (10**300 s was taken)
_UNITS = {
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    None: 1.0,
}


def parse_duration(key: str, value: object) -> float:
    """Seconds from ``"250ms"``, ``"5s"``, ``"1.5m"`` or a plain number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(key, value, "a duration such as '250ms' or '5s'")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            raise ConfigError(key, value, "a duration of a sensible size") from None
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ConfigError(key, value, "a duration such as '250ms' or '5s'")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(key, value, "a non-negative duration")
    if seconds > _MOST_S:
        raise ConfigError(key, value, "a duration of a sensible size")
    return seconds + 0.0  # (-0.0 is 0)


# To the next parameter: a password holding an unencoded # is what fails a URL's checks.
_PASSWORD = re.compile(r"(?i)(password=)[^&]*")


def _redacted(value: object) -> object:
    """``value`` with every string in it that may hold a URL's password redacted (the rest
    shown: a model name such as ``sonnet@20240620`` is only cut before its ``@``); a value of
    another kind that may hold one is not shown at all."""
    try:
        return _redact(value)
    except RecursionError:  # a list holding itself, or nested past reason
        return Redacted(value)


def _redact(value: object) -> object:
    if isinstance(value, str):
        return redact_url(value) if "@" in value or "password=" in value.lower() else value
    if type(value) is list:  # exactly: a named tuple is no sequence to rebuild
        return [_redact(v) for v in value]
    if type(value) is tuple:
        return tuple(_redact(v) for v in value)
    if type(value) is dict:
        return {_redact(k): _redact(v) for k, v in value.items()}
    shown = repr(value)
    return Redacted(value) if "@" in shown or "password=" in shown.lower() else value


def url_detail(value: str, why: str) -> str:
    """`` (why)`` for an error about URL ``value``, or nothing where the URL holds a password:
    a parser's words may quote a piece of it ("... as 'pa'")."""
    return "" if "@" in value else f" ({why})"


def redact_url(value: str) -> str:
    """``value`` with its password out: ``user:pw@`` and a ``password=`` query parameter
    (redis-py takes either). Over-redacts rather than under: everything between the scheme
    and the last ``@`` goes, wherever that ``@`` is (a password holding ``?``, ``/`` or ``#``
    unencoded is what makes such a URL fail its checks, and be printed)."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        # Not a URL as written (``redis:/user:pw@host``, a typo): cut before its last @ all
        # the same, and a password= parameter (``redis:/h?password=pw`` printed it).
        if "@" in value:
            value = "***@" + value.rpartition("@")[2]
        return _PASSWORD.sub(r"\1***", value)
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    # Wherever it stands (after ?, or after & or # where a ? was forgotten).
    return scheme + "://" + _PASSWORD.sub(r"\1***", rest)
