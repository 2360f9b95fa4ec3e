"""Prompt-structured workloads (``[workload.prompts]``): arrivals that carry their prompt as chat
messages, so that the KV cache (the emulator's, the simulator's) and a cache-aware router see
the prefixes real traffic shares. Three shapes, each generated from the scenario's seed alone:

* ``chat``: ``tenants`` each with a long system prompt of their own, ``users`` per tenant each
  in multi-turn conversations, one after the other; each turn resends the whole history (the
  system prompt, every question and answer so far) ``think_ms`` after the previous turn. The
  times are fixed by the seed, not by the answers: every router replays the same trace.
* ``shared``: one system prompt for everyone and short distinct questions, Poisson arrivals at
  the workload's ``rate`` (what defeats a hash of a prompt's first characters).
* ``rag``: ``documents`` long documents with Zipf-like popularity (weight ``1 / rank^zipf``),
  each query carrying ``per_query`` of them (drawn without replacement) after a short system
  prompt, then its question; Poisson arrivals at ``rate``.

Text is pseudo-words, four bytes a token as the shared rule counts them, so a prompt of N
tokens is exactly N tokens to every model of the cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from promptlb.shared import ConfigError, prompt_bytes, prompt_tokens

if TYPE_CHECKING:  # _scenario imports this module
    from ._scenario import Dist

__all__ = ["Messages", "Prompts", "message_tokens", "parse_prompts", "prompted_arrivals", "text"]

Kind = Literal["chat", "shared", "rag"]
Messages = tuple[tuple[str, str], ...]
_VOCABULARY = (
    "the a of to and in is for on that with as by at from it an be this are or which not was "
    "model node cache token prefix queue route request answer prompt system user tenant block "
    "memory latency batch engine server load share slot time first last next each every other "
    "document query context window history turn reply question reason plan check data value "
    "policy account order ticket invoice report summary table field record index update delete"
)
_WORDS = tuple(_VOCABULARY.split())


@dataclass(frozen=True, slots=True, kw_only=True)
class Prompts:
    """The ``[workload.prompts]`` table (see the module docstring); lengths in tokens, times in
    milliseconds, as `Dist` draws (``_scenario.Dist``: integers, clipped to lo..hi)."""

    kind: Kind
    system_tokens: Dist  # the tenant's (chat), the one (shared), the instructions (rag)
    question_tokens: Dist  # each user message
    answer_tokens: Dist  # each request's max_tokens, the reply later turns resend
    tenants: int = 1
    users: int = 1  # per tenant
    turns: Dist | None = None  # per conversation (chat)
    think_ms: Dist | None = None  # between a user's turns and conversations (chat)
    documents: int = 0
    document_tokens: Dist | None = None  # (rag)
    zipf: float = 1.0
    per_query: tuple[int, int] = (1, 3)

    def mean_rate(self) -> float:
        """A chat's requests per second: every user sends one turn per think time."""
        assert self.think_ms is not None
        return self.tenants * self.users / (self.think_ms.expected() / 1000)


def text(rng: random.Random, tokens: int) -> str:
    """``tokens`` tokens of pseudo-words: exactly ``4 * tokens`` ASCII bytes."""
    size = 4 * max(1, tokens)
    words = rng.choices(_WORDS, k=size // 3 + 1)  # words average over 3 letters with a space
    return " ".join(words)[:size]


def message_tokens(messages: Messages) -> int:
    """The prompt's tokens as the engine counts them (the chat template's text, not JSON)."""
    body = {"messages": [{"role": r, "content": c} for r, c in messages]}
    return prompt_tokens(prompt_bytes(body))


def prompted_arrivals(
    prompts: Prompts, rng: random.Random, duration: float, rate: float
) -> list[tuple[float, str, Messages, int, str]]:
    """The trace as (time, class, messages, max_tokens, session), sorted by time."""
    if prompts.kind == "chat":
        out = _chat(prompts, rng, duration)
    else:
        out = []
        t = 0.0
        shared = text(rng, prompts.system_tokens.draw(rng))
        length = prompts.document_tokens
        docs = [text(rng, length.draw(rng)) for _ in range(prompts.documents)] if length else []
        weights = [1.0 / (rank + 1) ** prompts.zipf for rank in range(prompts.documents)]
        while True:
            t += rng.expovariate(rate)
            if t >= duration:
                break
            question = text(rng, prompts.question_tokens.draw(rng))
            if prompts.kind == "rag":
                lo, hi = prompts.per_query
                chosen = _without_replacement(rng, weights, rng.randint(lo, hi))
                question = "\n\n".join(docs[i] for i in chosen) + "\n\n" + question
            messages: Messages = (("system", shared), ("user", question))
            out.append((t, prompts.kind, messages, prompts.answer_tokens.draw(rng), ""))
    out.sort(key=lambda a: a[0])
    return out


def _without_replacement(rng: random.Random, weights: list[float], k: int) -> list[int]:
    left = list(range(len(weights)))
    chosen: list[int] = []
    for _ in range(min(k, len(left))):
        pick = rng.choices(range(len(left)), weights=[weights[i] for i in left])[0]
        chosen.append(left.pop(pick))
    return chosen


def _chat(prompts: Prompts, rng: random.Random, duration: float) -> list[Any]:
    out: list[Any] = []
    think, turns = prompts.think_ms, prompts.turns
    assert think is not None and turns is not None
    for tenant in range(prompts.tenants):
        system = text(rng, prompts.system_tokens.draw(rng))
        for user in range(prompts.users):
            session = f"t{tenant}-u{user}"
            # Users start spread over one think time, so the run does not open with a wall.
            t = rng.uniform(0.0, think.expected() / 1000)
            while t < duration:
                history: Messages = (("system", system),)
                for _ in range(turns.draw(rng)):
                    history += (("user", text(rng, prompts.question_tokens.draw(rng))),)
                    answer = prompts.answer_tokens.draw(rng)
                    if t < duration:
                        out.append((t, "chat", history, answer, session))
                    # The next turn resends this one's answer (the emulator's own reply differs,
                    # but only the prompt's blocks are cached, and the trace must be fixed).
                    history += (("assistant", text(rng, answer)),)
                    t += think.draw(rng) / 1000
    return out


def _int(raw: dict[str, Any], key: str, low: int, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"workload.prompts.{key}", value, f"an integer >= {low}")
    return value


def parse_prompts(raw: Any, dist: Callable[[Any, str], Dist]) -> Prompts:
    """``[workload.prompts]``; ``dist(value, key)`` parses a length as `_scenario` does."""
    where = "workload.prompts"
    if not isinstance(raw, dict):
        raise ConfigError(where, raw, "a table with kind = chat, shared or rag")
    kind = raw.get("kind")
    if kind not in ("chat", "shared", "rag"):
        raise ConfigError(f"{where}.kind", kind, "chat, shared or rag")
    known = {"kind", "system_tokens", "question_tokens", "answer_tokens"}
    known |= {
        "chat": {"tenants", "users", "turns", "think_ms"},
        "shared": set(),
        "rag": {"documents", "document_tokens", "zipf", "per_query"},
    }[kind]
    for key in raw:
        if key not in known:
            raise ConfigError(f"{where}.{key}", raw[key], "one of " + ", ".join(sorted(known)))

    def length(key: str, default: Any) -> Dist:
        return dist(raw.get(key, default), f"{where}.{key}")

    per_query = raw.get("per_query", [1, 3])
    if (
        not isinstance(per_query, list)
        or len(per_query) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in per_query)
        or not 1 <= per_query[0] <= per_query[1]
    ):
        raise ConfigError(f"{where}.per_query", per_query, "[lo, hi] with 1 <= lo <= hi")
    zipf = raw.get("zipf", 1.0)
    if isinstance(zipf, bool) or not isinstance(zipf, int | float) or not 0 <= zipf <= 10:
        raise ConfigError(f"{where}.zipf", zipf, "a number in 0..10")
    return Prompts(
        kind=kind,
        system_tokens=length("system_tokens", 1000),
        question_tokens=length("question_tokens", 50),
        answer_tokens=length("answer_tokens", 100),
        tenants=_int(raw, "tenants", 1, 1),
        users=_int(raw, "users", 1, 1),
        turns=length("turns", 4) if kind == "chat" else None,
        think_ms=length("think_ms", 10000) if kind == "chat" else None,
        documents=_int(raw, "documents", 1, 20) if kind == "rag" else 0,
        document_tokens=length("document_tokens", 1000) if kind == "rag" else None,
        zipf=float(zipf),
        per_query=(per_query[0], per_query[1]),
    )
