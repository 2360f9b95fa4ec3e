"""Prompt classes for model-aware routing: a fast rules-based default, or a callable of yours
(``classifier = "package.module:callable"``), taking the request body and returning a class."""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

from promptlb.shared import BYTES_PER_TOKEN, ConfigError, prompt_turns

__all__ = ["CLASSES", "Classifier", "classify", "load_classifier"]

CLASSES = ("simple_qa", "creative", "code", "long_context")
Classifier = Callable[[Mapping[str, Any]], str]
_log = logging.getLogger("promptlb.middleware")

LONG_CONTEXT_CHARS = 16_000  # about 4k tokens of prompt
# Word sets and substring tests, not regexes: str.translate, split and set lookups run in C, so
# a 4k-character prompt classifies in a few tens of microseconds.
_CODE_MARKS = ("```", "def ", "#include", "import ", "=>", "();", "{\n", "SELECT ", "</")
_CODE_WORDS = frozenset(
    [
        "code",
        "function",
        "bug",
        "compile",
        "compiler",
        "python",
        "javascript",
        "typescript",
        "rust",
        "golang",
        "java",
        "sql",
        "regex",
        "bash",
        "script",
        "debug",
        "refactor",
        "stacktrace",
        "traceback",
        "api",
        "json",
        "yaml",
    ]
)
_CREATIVE_VERBS = frozenset(["write", "compose", "draft", "imagine", "invent", "create", "tell"])
_CREATIVE_NOUNS = frozenset(
    [
        "story",
        "poem",
        "song",
        "lyrics",
        "essay",
        "novel",
        "tale",
        "haiku",
        "limerick",
        "fable",
        "sonnet",
        "screenplay",
    ]
)
_PUNCTUATION = str.maketrans({c: " " for c in "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~\n\t"})


def _texts(body: Mapping[str, Any]) -> tuple[str, int]:
    """The last user turn's text and the prompt's total length in characters; a completion
    batch's prompts count as one text."""
    last = ""
    total = 0
    batch: list[str] = []
    for role, pieces in prompt_turns(body):
        text = pieces[0] if len(pieces) == 1 else " ".join(pieces)
        if role is None:
            batch.append(text)
            continue
        total += len(text)
        if role == "user":
            last = text
    if batch:
        last = batch[0] if len(batch) == 1 else " ".join(batch)
        total = len(last)
    elif not total and isinstance(prompt := body.get("prompt"), list) and prompt:
        # Token ids (a completion's other form): no text, but their length is known. A 40,000-
        # token prompt was simple_qa.
        # A batch of them counts whole, as a batch of texts does.
        if isinstance(prompt[0], list):
            total = BYTES_PER_TOKEN * sum(len(p) for p in prompt if isinstance(p, list))
        else:
            total = BYTES_PER_TOKEN * len(prompt)
    return last, total


def classify(body: Mapping[str, Any]) -> str:
    """``long_context`` | ``code`` | ``creative`` | ``simple_qa``, by rules."""
    text, total = _texts(body)
    if total > LONG_CONTEXT_CHARS:
        return "long_context"
    # The start and end of a long turn carry the instruction; the middle is pasted material.
    probe = text if len(text) <= 4096 else text[:2048] + "\n" + text[-2048:]
    if any(mark in probe for mark in _CODE_MARKS):
        return "code"
    # Words from the ends only: where the instruction is, and half the work on a long turn.
    ends = probe if len(probe) <= 1024 else probe[:512] + " " + probe[-512:]
    words = set(ends.lower().translate(_PUNCTUATION).split())
    if not words.isdisjoint(_CODE_WORDS):
        return "code"
    if ("once" in words and "upon" in words) or (
        not words.isdisjoint(_CREATIVE_VERBS) and not words.isdisjoint(_CREATIVE_NOUNS)
    ):
        return "creative"
    return "simple_qa"


def load_classifier(spec: str | None) -> Classifier:
    """The default classifier, or the callable named ``package.module:callable``."""
    if spec is None:
        return classify
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError("classifier", spec, "'package.module:callable'")
    try:
        found = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # its import may raise anything (a SyntaxError, its own errors)
        raise ConfigError("classifier", spec, f"an importable callable ({exc!r})") from None
    if not callable(found):
        raise ConfigError("classifier", spec, "a callable")
    if inspect.iscoroutinefunction(found) or inspect.iscoroutinefunction(
        getattr(found, "__call__", None)  # noqa: B004 (an object's async __call__)
    ):
        # Called on the request's path without an await: each call's coroutine was no class
        # (logged, never awaited) and the default's class was used, for good.
        raise ConfigError("classifier", spec, "a plain callable, not an async one")
    return _guarded(spec, found)


def _guarded(spec: str, user: Callable[[Mapping[str, Any]], object]) -> Classifier:
    """The user's classifier, where a raise or an answer that is not a string gives the
    default's class, logged once per kind: it escaped as a bare 500 with a traceback on every
    request it failed."""
    told: set[str] = set()

    def classifier(body: Mapping[str, Any]) -> str:
        try:
            found = user(body)
        except Exception as exc:  # the user's code: anything it raises
            problem = f"raised {type(exc).__name__}: {exc}"
        else:
            if isinstance(found, str):
                return found
            if inspect.iscoroutine(found):
                found.close()  # (never awaited: no warning for it on every request)
            problem = f"returned {type(found).__name__}, not a string"
        if problem not in told and len(told) < 16:
            told.add(problem)
            _log.error("classifier %s %s; the default's class is used", spec, problem)
        return classify(body)

    return classifier
