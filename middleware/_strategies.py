"""The strategy registry: every strategy by its config name, built with its options.

A strategy that wraps another (``model_aware`` narrows the candidates for an inner strategy,
``predictive`` follows ``p2c`` until it has learnt the nodes) is handed its inner strategy
built here, so composition runs one way: the registry builds inward-out and no strategy module
imports the registry. ``STRATEGIES`` is the one list of names; the config checks against it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from promptlb.shared import ConfigError

from ._model_aware import ModelAware
from ._predictive import Predictive
from ._scoring import PowerOfTwoChoices, Resource
from ._simple import LeastConn, RoundRobin, Weighted
from ._strategy import Strategy

__all__ = ["DEFAULT_STRATEGY", "STRATEGIES", "make_strategy"]

DEFAULT_STRATEGY = Predictive.name

_ALL = (RoundRobin, Weighted, LeastConn, Resource, PowerOfTwoChoices, ModelAware, Predictive)
STRATEGIES: Mapping[str, type[Strategy]] = {cls.name: cls for cls in _ALL}

# The strategies that take an inner one: (the option naming it, or None when it is fixed; the
# option holding its options; the inner strategy by default).
_WRAPS: Mapping[str, tuple[str | None, str, str]] = {
    ModelAware.name: ("inner", "inner_options", PowerOfTwoChoices.name),
    Predictive.name: (None, "p2c_options", PowerOfTwoChoices.name),
}


def options_of(name: str) -> list[str]:
    """The options strategy ``name`` accepts in ``strategy_options``."""
    accepted = [p for p in inspect.signature(STRATEGIES[name]).parameters if p != "inner"]
    wraps = _WRAPS.get(name)
    if wraps is not None:
        accepted += [key for key in wraps[:2] if key is not None]
    return accepted


def make_strategy(name: str, **options: Any) -> Strategy:
    """The strategy called ``name``, built with ``options`` (the config's strategy_options).

    Raises `ConfigError` (a `ValueError`) for an unknown name, an unknown option or a bad value;
    an error in an inner strategy's options names its path (``inner_options.sample``).
    """
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ConfigError("strategy", name, "one of " + ", ".join(sorted(STRATEGIES)))
    accepted = options_of(name)
    for key, value in options.items():
        if key not in accepted:
            takes = ", ".join(accepted) if accepted else "none"
            raise ConfigError(key, value, f"an option of {name!r} (its options: {takes})")
    wraps = _WRAPS.get(name)
    if wraps is not None:
        name_key, options_key, default = wraps
        inner = options.pop(name_key, default) if name_key is not None else default
        if inner == name:
            raise ConfigError(name_key or options_key, inner, f"another strategy than {name}")
        inner_options = options.pop(options_key, None)
        if inner_options is None:
            inner_options = {}
        if not isinstance(inner_options, Mapping):  # false, "", 0 or [] too: a typo
            raise ConfigError(options_key, inner_options, f"a table of {inner!r}'s options")
        try:
            options["inner"] = make_strategy(inner, **inner_options)
        except ConfigError as exc:
            outer = name_key or options_key
            key = outer if exc.key == "strategy" else f"{options_key}.{exc.key}"
            raise ConfigError(key, exc.value, exc.expected) from None
    try:
        return STRATEGIES[name](**options)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        # A value of a type the strategy's own checks did not foresee: a config error, not a
        # traceback at start (or out of a reload).
        raise ConfigError("strategy_options", options, f"options {name!r} takes ({exc})") from None
