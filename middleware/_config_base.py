"""Validation helpers shared by the configuration modules."""

from __future__ import annotations

import math
from urllib.parse import urlsplit

from promptlb.shared import ConfigError

__all__ = ["DURATION", "check_url", "positive", "whole_number"]

DURATION = {"duration": True}  # field metadata: accepts "250ms", "5s" or seconds


def check_url(key: str, value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, value, "an http(s) URL such as http://10.0.0.1:8000")
    return value.rstrip("/")


def positive(key: str, value: float, *, zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(key, value, "a finite number")
    if value < 0 or (value == 0 and not zero):
        raise ConfigError(key, value, ">= 0" if zero else "> 0")


def whole_number(key: str, value: object, low: int) -> int:
    # bool is an int subclass, and `true` where a count belongs is a config mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(key, value, f"an integer >= {low}")
    return value
