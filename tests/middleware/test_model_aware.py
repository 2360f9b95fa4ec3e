"""Model-aware routing: the rules-based classifier, the strategy over tagged nodes, and the
classes reaching their nodes end to end through the openai client."""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from promptlb.middleware._classify import classify, load_classifier
from promptlb.middleware._config import load_config
from promptlb.middleware._model_aware import ModelAware
from promptlb.middleware._nodes import NodeTable
from promptlb.middleware._request import RequestReader
from promptlb.middleware._shedding import Admission
from promptlb.middleware._strategies import make_strategy
from promptlb.middleware._view import NodeView, RouteRequest
from promptlb.shared import ConfigError

from tests.middleware.conftest import Flags, MakeCluster, MakeNode


def chat(text: str, system: str = "") -> dict[str, object]:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": [*messages, {"role": "user", "content": text}]}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("What is the capital of France?", "simple_qa"),
        ("How many legs does a spider have?", "simple_qa"),
        ("Write a short story about a lighthouse keeper.", "creative"),
        ("Compose a poem about autumn rain", "creative"),
        ("Fix this bug:\n```python\ndef f(x): return x +\n```", "code"),
        ("Write a Python function that reverses a list", "code"),
        ("SELECT name FROM users WHERE id = 3 is slow, why?", "code"),
        ("Summarize this: " + "lorem ipsum dolor sit amet " * 700, "long_context"),
    ],
)
def test_the_rules_classify_prompts(text: str, expected: str) -> None:
    assert classify(chat(text)) == expected


def test_the_last_user_turn_decides_and_prompts_work_too() -> None:
    system = "You are a helpful assistant that can write code and poems."
    assert classify(chat("What time zone is Tokyo in?", system)) == "simple_qa"
    assert classify({"prompt": "def add(a, b):"}) == "code"
    assert classify({"prompt": ["once upon a time"]}) == "creative"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "import os"}]}]}
    assert classify(parts) == "code"
    assert classify({}) == "simple_qa"
    # Token ids: no text, but a length (a 40,000-token prompt was simple_qa).
    assert classify({"prompt": list(range(40_000))}) == "long_context"
    assert classify({"prompt": [list(range(40_000)), [1, 2]]}) == "long_context"
    assert classify({"prompt": [[1] * 500] * 10}) == "long_context"  # a batch counts whole
    assert classify({"prompt": [1, 2, 3]}) == "simple_qa"


def test_a_4k_prompt_classifies_in_microseconds() -> None:
    notes = ("The meeting notes say the budget grew and the team " * 80)[:4000]
    body = chat(notes + " Now write a limerick about it.")
    runs = 2000
    started = time.perf_counter()
    classes = {classify(body) for _ in range(runs)}
    per_call = (time.perf_counter() - started) / runs
    print(f"classify 4k chars: {per_call * 1e6:.1f} us")  # the 50 us goal, reported, not held
    assert classes == {"creative"}  # the instruction at the end of a long turn, read each time


_USER_MODULES = {
    # A user's classifier with bugs.
    "user_classifier_buggy": (
        "def classify(body):\n"
        "    if body.get('boom'):\n"
        "        raise KeyError('messages')\n"
        "    return None if body.get('none') else 'mine'\n"
    ),
    # One that fails as it is imported.
    "user_classifier_broken": "raise RuntimeError('this module cannot be imported')\n",
    # An async one, as a function and as an object's __call__.
    "user_classifier_async": (
        "async def classify(body):\n"
        "    return 'code'\n"
        "class Model:\n"
        "    async def __call__(self, body):\n"
        "        return 'code'\n"
        "model = Model()\n"
    ),
}


def test_a_custom_classifier_is_loaded_by_name(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, source in _USER_MODULES.items():
        (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
        monkeypatch.delitem(sys.modules, name, raising=False)  # gone again after the test
    monkeypatch.syspath_prepend(str(tmp_path))
    body = {"messages": [{"role": "user", "content": "def f(): pass"}]}
    assert load_classifier("promptlb.middleware._classify:classify")(body) == classify(body)
    # A raise or an answer that is not a string: the default's class, logged once a kind (it
    # escaped as a bare 500 on every request).
    mine = load_classifier("user_classifier_buggy:classify")
    assert mine({"x": 1}) == "mine"
    for _ in range(3):
        assert mine({**body, "boom": True}) == classify(body)
        assert mine({**body, "none": True}) == classify(body)
    assert len([r for r in caplog.records if "classifier" in r.message]) == 2
    for bad in ("nomodule", "promptlb.nothere:x", "promptlb.middleware._classify:CLASSES"):
        with pytest.raises(ConfigError, match="classifier"):
            load_classifier(bad)
    # A module that fails as it is imported: a config error, not the gateway's traceback.
    with pytest.raises(ConfigError, match="classifier") as info:
        load_classifier("user_classifier_broken:classify")
    assert "RuntimeError" in str(info.value)
    # An async classifier was taken, then each request's coroutine was no class (never
    # awaited) and the default's class was used, for good: refused where it is named.
    for spec in ("user_classifier_async:classify", "user_classifier_async:model"):
        with pytest.raises(ConfigError, match="not an async one"):
            load_classifier(spec)


def test_the_class_is_of_the_prompt_the_endpoint_reads() -> None:
    # A completion body that also carried messages was classed by its messages, which its
    # node never reads (a 40,000-character prompt classed "creative" for a haiku request).
    config = load_config(
        {
            "nodes": [{"name": "a", "url": "http://127.0.0.1:9"}],
            "classifier": "promptlb.middleware._classify:classify",
        }
    )
    reader = RequestReader(config, Admission(config.shedding, NodeTable(config)))
    haiku = [{"role": "user", "content": "write a haiku about the sea"}]
    body = {"model": "m", "prompt": "x" * 40_000, "messages": haiku}
    assert reader.build("/v1/completions", body).route.prompt_class == classify(
        {"prompt": "x" * 40_000}
    )
    assert reader.build("/v1/chat/completions", body).route.prompt_class == classify(
        {"messages": haiku}
    )
    assert classify({"prompt": "x" * 40_000}) != classify({"messages": haiku})


def test_the_strategy_keeps_each_class_on_its_nodes(node: MakeNode) -> None:
    strategy = make_strategy(
        "model_aware",
        routes={"code": ["coder"], "simple_qa": ["light"]},
        default=["big"],
        inner="round_robin",
    )
    nodes = [
        node("a", tags={"light"}),
        node("b", tags={"coder"}),
        node("c", tags={"big"}),
        node("d", tags={"light"}),
    ]
    rng = random.Random(1)

    def picks(cls: str) -> set[str]:
        request = RouteRequest(model="m", prompt_class=cls)
        return {strategy.pick(request, nodes, rng).name for _ in range(8)}

    assert picks("code") == {"b"}
    assert picks("simple_qa") == {"a", "d"}
    assert picks("creative") == {"c"}  # no route: the default
    # No node matches the route nor the default: every candidate.
    only = [node("x"), node("y")]
    request = RouteRequest(model="m", prompt_class="code")
    assert {strategy.pick(request, only, rng).name for _ in range(8)} == {"x", "y"}


def test_alternating_classes_each_take_turns_over_their_own_nodes(node: MakeNode) -> None:
    # One round-robin turn per model: code, chat, code, chat... sent every code request to
    # the even place of its list and every chat to the odd one, and half the nodes idled.
    strategy = make_strategy(
        "model_aware", routes={"code": ["coder"], "simple_qa": ["light"]}, inner="round_robin"
    )
    nodes = [
        node("c1", tags={"coder"}),
        node("c2", tags={"coder"}),
        node("l1", tags={"light"}),
        node("l2", tags={"light"}),
    ]
    rng = random.Random(2)
    code = RouteRequest(model="m", prompt_class="code")
    chat = RouteRequest(model="m", prompt_class="simple_qa")
    got: Counter[str] = Counter()
    for _ in range(100):
        got[strategy.pick(code, nodes, rng).name] += 1
        got[strategy.pick(chat, nodes, rng).name] += 1
    assert got == {"c1": 50, "c2": 50, "l1": 50, "l2": 50}


def test_bad_model_aware_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"routes\.code"):
        make_strategy("model_aware", routes={"code": "coder"})
    with pytest.raises(ConfigError, match="inner"):
        make_strategy("model_aware", inner="model_aware")
    with pytest.raises(ConfigError, match="inner_options"):
        make_strategy("model_aware", inner="p2c", inner_options={"nope": 1})
    # Silently "the default" before: an empty route, a falsy table of options.
    with pytest.raises(ConfigError, match=r"routes\.code"):
        make_strategy("model_aware", routes={"code": []})
    falsies: tuple[object, ...] = (False, "", 0, [])
    for falsy in falsies:
        with pytest.raises(ConfigError, match="inner_options"):
            make_strategy("model_aware", inner="p2c", inner_options=falsy)
    make_strategy("model_aware", default=[])  # no default pool: every candidate


async def test_classes_reach_their_nodes_through_the_openai_client(
    cluster: MakeCluster, fast: Flags
) -> None:
    config = (
        "strategy = 'model_aware'\nclass_header = 'x-prompt-class'\n"
        "[strategy_options]\ninner = 'least_conn'\ndefault = ['general']\n"
        "[strategy_options.routes]\ncode = ['coder']\nsimple_qa = ['light']\n"
    )
    c = cluster({"coder": fast, "light": fast, "general": fast}, config)
    api = c.client()

    async def node_for(text: str, headers: dict[str, str] | None = None) -> str:
        raw = await api.chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": text}],
            max_tokens=2,
            extra_headers=headers,
        )
        raw.parse()
        node: str = raw.headers["x-promptlb-node"]
        return node

    for _ in range(3):
        assert await node_for("Write a Python function to parse JSON") == "coder"
        assert await node_for("What is the capital of Peru?") == "light"
        assert await node_for("Write a poem about the sea") == "general"
    # The trusted header names the class itself.
    headers = {"x-prompt-class": "code"}
    assert await node_for("What is the capital of Peru?", headers) == "coder"


def test_the_narrowing_is_kept_per_class_while_the_candidate_list_stays_the_same() -> None:
    """A new narrowed list each pick made the inner strategy's per-list state (weighted's
    cumulative weights) rebuild on every pick: at 1,000 nodes 165 us where 3 us."""
    inner = make_strategy("weighted")
    strategy = ModelAware(inner, routes={"code": ["coder"]})
    views = [
        NodeView(name=f"n{i}", url="http://n", tags=frozenset({"coder"} if i % 2 else ()))
        for i in range(10)
    ]
    code = RouteRequest(model="m", prompt_class="code")
    first = strategy.narrow(code, views)
    assert [v.name for v in first] == [f"n{i}" for i in range(1, 10, 2)]
    assert strategy.narrow(code, views) is first  # the same list: the same narrowing
    assert strategy.narrow(code, list(views)) is not first  # another list: narrowed again
    # Per model: another model's list (the table keeps one a model) evicted it at every pick
    # while the two interleaved.
    mine, theirs = list(views), list(views)
    other = RouteRequest(model="embed", prompt_class="code")
    kept = strategy.narrow(code, mine)
    strategy.narrow(other, theirs)
    assert strategy.narrow(code, mine) is kept
