"""The scenario parser: shipped scenarios load, bad values name their key, traces are seeded."""

from __future__ import annotations

import copy
import hashlib
import itertools
from pathlib import Path
from typing import Any

import pytest
from promptlb.bench._scenario import SCENARIOS, load_scenario, parse_scenario
from promptlb.shared import ConfigError


def _valid() -> dict[str, Any]:
    """A small scenario with a fixed rate: its trace is cheap to draw."""
    return {
        "name": "tiny",
        "duration": "30s",
        "seed": 5,
        "workload": {
            "rate": 20,
            "mix": [
                {
                    "name": "qa",
                    "share": 0.75,
                    "prompt_tokens": {"dist": "lognormal", "mean": 80, "sigma": 0.6},
                    "max_tokens": {"dist": "lognormal", "mean": 40, "sigma": 0.6, "hi": 400},
                },
                {"name": "gen", "share": 0.25, "prompt_tokens": 200, "max_tokens": 300},
            ],
        },
        "nodes": [
            {"name": "big", "slots": 16, "tokens_per_s": 100, "ttft_ms": 50},
            {
                "name": "small",
                "slots": 4,
                "tokens_per_s": 30,
                "faults": [{"at": "10s", "kind": "crash"}, {"at": "20s", "kind": "recover"}],
            },
        ],
    }


def test_every_shipped_scenario_loads() -> None:
    paths = sorted(SCENARIOS.glob("*.toml"))
    names = {p.stem for p in paths}
    assert {"seed-3am", "hetero-8", "uniform-4", "burst"} <= names
    for path in paths:
        scenario = load_scenario(path.stem)
        assert scenario.name == path.stem
        assert scenario.nodes and scenario.duration > 0
        assert scenario.workload.mix
        assert scenario.capacity() > 0
        assert scenario.base_rate > 0


def test_shipped_scenarios_tell_their_story() -> None:
    hetero = load_scenario("hetero-8")
    assert len(hetero.nodes) == 8
    assert len({(n.slots, n.tokens_per_s, n.ttft_ms) for n in hetero.nodes}) == 3
    assert hetero.workload.load == pytest.approx(0.85)
    seed = load_scenario("seed-3am")
    kinds = {f.kind for n in seed.nodes for f in n.faults}
    assert {"leak", "crash"} <= kinds
    burst = load_scenario("burst")
    load = burst.workload.load
    assert load == pytest.approx(0.5)
    assert load is not None
    assert [b.factor * load for b in burst.workload.bursts] == [pytest.approx(1.2)]


def test_a_path_loads_too(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(
        'duration = "5s"\n[workload]\nrate = 3\n[[nodes]]\nname = "solo"\n', encoding="utf-8"
    )
    scenario = load_scenario(str(path))
    assert scenario.name == "mine"
    assert [n.name for n in scenario.nodes] == ["solo"]
    assert scenario.nodes[0].slots == 8  # the emulator's defaults
    assert scenario.workload.mix[0].name == "default"


@pytest.mark.parametrize(
    ("path", "value", "key"),
    [
        (("nodes", 0, "tokens_per_s"), -1, "nodes[0].tokens_per_s"),
        (("nodes", 0, "tokens_per_s"), "fast", "nodes[0].tokens_per_s"),
        (("nodes", 0, "tokens_per_s"), 0, "nodes[0].tokens_per_s"),
        (("nodes", 1, "ttft_ms"), -5, "nodes[1].ttft_ms"),
        (("nodes", 0, "slots"), True, "nodes[0].slots"),
        (("nodes", 0, "slots"), 0, "nodes[0].slots"),
        (("nodes", 1, "faults", 0, "value"), 2.0, "nodes[1].faults[0].value"),  # a crash's
        (("nodes", 1, "faults", 0, "kind"), "explode", "nodes[1].faults[0].kind"),
        (("nodes", 1, "memory_limit_mb"), 0, "nodes[1].memory_limit_mb"),
        (("nodes", 1, "memory_limit_mb"), 512.5, "nodes[1].memory_limit_mb"),
        (("nodes", 1, "memory_limit_mb"), "1G", "nodes[1].memory_limit_mb"),
        (("nodes", 1, "memory_limit_mb"), True, "nodes[1].memory_limit_mb"),
        (("nodes", 1, "faults", 0, "at"), "soonish", "nodes[1].faults[0].at"),
        (("workload", "mix", 0, "max_tokens", "dist"), "pareto", "workload.mix[0].max_tokens.dist"),
        (("workload", "mix", 0, "max_tokens", "lo"), 500, "workload.mix[0].max_tokens.lo"),
        (("workload", "mix", 1, "prompt_tokens"), "long", "workload.mix[1].prompt_tokens"),
        (("workload", "mix", 0, "share"), 0, "workload.mix[0].share"),
        (("workload", "load"), 0.5, "workload"),  # rate and load both
        (("workload", "rate"), -2, "workload.rate"),
        (("duration",), "soon", "duration"),
        (("duration",), 0, "duration"),
        (("colour",), "blue", "colour"),
        (("nodes",), [], "nodes"),
    ],
)
def test_bad_values_name_their_key(path: tuple[str | int, ...], value: object, key: str) -> None:
    data = _valid()
    target: Any = data
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == key


@pytest.mark.parametrize(
    ("kind", "value", "ok"),
    [
        ("slow", 3, True),
        ("slow", 0, True),  # the default factor
        ("slow", -3, False),
        ("slow", float("nan"), False),
        ("slow", "abc", False),
        ("leak", 4, True),
        ("leak", 5000, False),  # past the emulator's bound: it refused, the run went without
        ("leak", -1, False),
        ("slow", 1e-320, False),  # an infinite decode rate: every request a 500
        ("slow", 10**400, False),  # past a float: OverflowError, not a ConfigError
    ],
)
def test_fault_values_are_checked_as_the_emulator_checks_them(
    kind: str, value: object, ok: bool
) -> None:
    data = _valid()
    data["nodes"][1]["faults"] = [{"at": "10s", "kind": kind, "value": value}]
    if ok:
        assert parse_scenario(data).nodes[1].faults[0].value == value
        return
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == "nodes[1].faults[0].value"


def test_workload_needs_exactly_one_of_rate_and_load() -> None:
    data = _valid()
    del data["workload"]["rate"]
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == "workload"
    data["workload"]["load"] = 3.0
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == "workload.load"


def test_node_names_are_required_and_unique() -> None:
    data = _valid()
    del data["nodes"][0]["name"]
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == "nodes[0].name"
    data = _valid()
    data["nodes"][1]["name"] = "big"
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == "nodes"


def test_unreadable_or_invalid_files_name_the_scenario(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_scenario(str(tmp_path / "missing.toml"))
    assert err.value.key == "scenario"
    bad = tmp_path / "bad.toml"
    bad.write_text("nodes = [", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_scenario(str(bad))
    assert err.value.key == "scenario"


def test_count_replicates_nodes_with_unique_names() -> None:
    data = _valid()
    data["nodes"][0]["count"] = 3
    scenario = parse_scenario(data)
    names = [n.name for n in scenario.nodes]
    assert names == ["big-1", "big-2", "big-3", "small"]
    copies = scenario.nodes[:3]
    assert {(n.slots, n.tokens_per_s, n.ttft_ms) for n in copies} == {(16, 100.0, 50.0)}


def test_faults_are_parsed_in_seconds() -> None:
    small = parse_scenario(_valid()).nodes[1]
    assert [(f.at, f.kind) for f in small.faults] == [(10.0, "crash"), (20.0, "recover")]


def test_a_node_may_give_its_model_servers_memory_limit() -> None:
    data = _valid()
    data["nodes"][1]["memory_limit_mb"] = 300
    big, small = parse_scenario(data).nodes
    assert (big.memory_limit_mb, small.memory_limit_mb) == (None, 300)
    # seed-3am's node C dies of its leak: it alone has a limit, the others the sidecar's default.
    limits = {n.name: n.memory_limit_mb for n in load_scenario("seed-3am").nodes}
    assert limits == {"node-a": None, "node-b": None, "node-c": 300}


def test_arrivals_are_deterministic_for_a_seed() -> None:
    scenario = parse_scenario(_valid())
    first = scenario.arrivals()
    assert first == scenario.arrivals()
    assert first == parse_scenario(copy.deepcopy(_valid())).arrivals()
    assert first != scenario.arrivals(seed=6)
    times = [a.at for a in first]
    assert times == sorted(times)
    assert times[0] > 0 and times[-1] < scenario.duration


def test_arrivals_follow_the_rate_and_the_mix() -> None:
    data = _valid()
    data["duration"] = "300s"
    scenario = parse_scenario(data)
    arrivals = scenario.arrivals()
    # 6,000 expected: a Poisson count's sd is 1.3%, so 5% is a safe band.
    assert len(arrivals) == pytest.approx(20 * 300, rel=0.05)
    qa = sum(1 for a in arrivals if a.prompt_class == "qa") / len(arrivals)
    assert qa == pytest.approx(0.75, abs=0.03)
    assert all(1 <= a.max_tokens <= 400 for a in arrivals if a.prompt_class == "qa")
    assert {a.max_tokens for a in arrivals if a.prompt_class == "gen"} == {300}
    mean_qa = [a.max_tokens for a in arrivals if a.prompt_class == "qa"]
    assert sum(mean_qa) / len(mean_qa) == pytest.approx(40, rel=0.08)  # lognormal keeps its mean


def test_bursts_raise_the_rate_in_their_window() -> None:
    data = _valid()
    data["duration"] = "90s"
    data["workload"]["bursts"] = [{"at": "30s", "duration": "30s", "factor": 3}]
    scenario = parse_scenario(data)
    assert scenario.rate_at(10) == 20 and scenario.rate_at(45) == 60 and scenario.rate_at(60) == 20
    arrivals = scenario.arrivals()
    inside = sum(1 for a in arrivals if 30 <= a.at < 60)
    outside = len(arrivals) - inside
    # 1,800 inside against 600 per 30 s outside: a ratio of 3, within a few sd.
    assert inside / (outside / 2) == pytest.approx(3.0, rel=0.15)


def test_overlapping_bursts_multiply_and_their_trace_follows() -> None:
    data = _valid()
    data["duration"] = "90s"
    data["workload"]["bursts"] = [
        {"at": "20s", "duration": "40s", "factor": 2},
        {"at": "40s", "duration": "40s", "factor": 2},
    ]
    scenario = parse_scenario(data)
    assert scenario.rate_at(50) == 80  # 20/s, twice twice
    arrivals = scenario.arrivals()
    overlap = sum(1 for a in arrivals if 40 <= a.at < 60) / 20
    assert overlap == pytest.approx(80, rel=0.1)  # thinned against one burst's peak: 38/s
    # A lull (factor below 1) ending inside a burst: the most is at the lull's end.
    data["workload"]["bursts"] = [
        {"at": "0s", "duration": "50s", "factor": 0.5},
        {"at": "25s", "duration": "50s", "factor": 4},
    ]
    scenario = parse_scenario(data)
    after = sum(1 for a in scenario.arrivals() if 50 <= a.at < 75) / 25
    assert after == pytest.approx(80, rel=0.1)  # 40/s against a peak at a start alone


def test_scenario_tables_refuse_keys_they_do_not_know() -> None:
    # A misspelt key (slot = 1) was its default, silently; only the top level's were refused.
    for path, key in (
        (("nodes", 0), "nodes[0].slot"),
        (("workload", "mix", 0), "workload.mix[0].prompt_token"),
        (("nodes", 1, "faults", 0), "nodes[1].faults[0].factor"),
        (("workload",), "workload.ratee"),
        (("workload", "mix", 0, "max_tokens"), "workload.mix[0].max_tokens.sgima"),
    ):
        data = _valid()
        target: Any = data
        for step in path:
            target = target[step]
        target[key.rsplit(".", 1)[1]] = 1
        with pytest.raises(ConfigError) as err:
            parse_scenario(data)
        assert err.value.key == key


def test_load_follows_capacity() -> None:
    data = _valid()
    del data["workload"]["rate"]
    data["workload"]["load"] = 0.5
    scenario = parse_scenario(data)
    assert scenario.base_rate == pytest.approx(0.5 * scenario.capacity())
    big = scenario.nodes[0]
    mean_out = sum(c.share * c.max_tokens.expected() for c in scenario.workload.mix)
    assert big.capacity(mean_out) == pytest.approx(16 / (0.05 + mean_out / 100))


def test_strategy_options_are_per_strategy_tables() -> None:
    mixed = load_scenario("mixed-class")
    routes = mixed.strategy_options["model_aware"]["routes"]
    assert routes["code"] == ["code"]
    tags = {t for n in mixed.nodes for t in n.tags}
    # Every route names tags the scenario's nodes carry, and every class of the mix has one.
    assert {t for ts in routes.values() for t in ts} <= tags
    assert {c.name for c in mixed.workload.mix} <= set(routes)
    with pytest.raises(ConfigError, match=r"strategy_options\.p2c"):
        parse_scenario({**_valid(), "strategy_options": {"p2c": 3}}, default_name="bad")


def test_targets_are_declared_by_the_scenarios_they_speak_of() -> None:
    # Issue 5: vs round robin and LiteLLM on seed-3am and hetero-8; the bound everywhere.
    for name in ("seed-3am", "hetero-8"):
        assert load_scenario(name).targets == {
            "p99_vs_round_robin": 0.5,
            "p99_vs_best_litellm": 0.8,
            "p99_vs_perfect": 1.3,
        }
    for name in ("uniform-4", "burst", "mixed-class"):
        assert load_scenario(name).targets == {"p99_vs_perfect": 1.3}
    assert parse_scenario(_valid()).targets == {}


@pytest.mark.parametrize(
    ("targets", "key"),
    [
        ({"p99_vs_nginx": 0.5}, "targets.p99_vs_nginx"),
        ({"p99_vs_perfect": 0}, "targets.p99_vs_perfect"),
        ({"p99_vs_perfect": float("inf")}, "targets.p99_vs_perfect"),
        ({"p99_vs_perfect": True}, "targets.p99_vs_perfect"),
        ({"p99_vs_perfect": "1.3"}, "targets.p99_vs_perfect"),
        ([0.5], "targets"),
    ],
)
def test_bad_targets_name_their_key(targets: object, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_scenario({**_valid(), "targets": targets})
    assert err.value.key == key


# The traces of the scenarios from before prompts, fingerprinted at the commit that added them
# (99ca8f4): prompts must not move a single draw of theirs.
_OLD_TRACES = {
    "seed-3am": (1091, "7622d7ffbb75204c"),
    "hetero-8": (2688, "0d17e5c08b1b9dc1"),
    "uniform-4": (729, "8ed848d453a577c9"),
    "burst": (1846, "6e17dbd5c54351a5"),
    "mixed-class": (2962, "8846f03d1636bedc"),
}


@pytest.mark.parametrize("name", sorted(_OLD_TRACES))
def test_the_scenarios_without_prompts_keep_their_traces(name: str) -> None:
    arrivals = load_scenario(name).arrivals()
    fields = repr([(a.at, a.prompt_class, a.prompt_tokens, a.max_tokens) for a in arrivals])
    assert (len(arrivals), hashlib.sha256(fields.encode()).hexdigest()[:16]) == _OLD_TRACES[name]
    assert not any(a.messages for a in arrivals)
    assert all(n.kv_blocks == 0 for n in load_scenario(name).nodes)


def _chat() -> dict[str, Any]:
    return {
        "duration": "40s",
        "seed": 3,
        "workload": {
            "prompts": {
                "kind": "chat",
                "tenants": 3,
                "users": 2,
                "system_tokens": 300,
                "question_tokens": 20,
                "answer_tokens": 30,
                "turns": {"dist": "uniform", "lo": 2, "hi": 4},
                "think_ms": {"dist": "fixed", "mean": 2000},
            }
        },
        "nodes": [{"name": "n", "count": 2, "kv_blocks": 500, "prefill_tokens_per_s": 1000}],
    }


def test_a_chat_resends_its_history_each_turn() -> None:
    scenario = parse_scenario(_chat())
    arrivals = scenario.arrivals()
    assert arrivals == parse_scenario(_chat()).arrivals()  # the seed alone fixes it
    assert [a.at for a in arrivals] == sorted(a.at for a in arrivals)
    assert all(0 <= a.at < 40 for a in arrivals)
    # 6 users, one turn per 2 s of think time each.
    assert scenario.base_rate == pytest.approx(3.0)
    assert len(arrivals) == pytest.approx(3.0 * 40, rel=0.1)
    sessions: dict[str, list[Any]] = {}
    for a in arrivals:
        sessions.setdefault(a.session, []).append(a)
    assert len(sessions) == 6
    systems = set()
    for turns in sessions.values():
        systems.add(turns[0].messages[0])
        for before, after in itertools.pairwise(turns):
            if len(after.messages) > len(before.messages):  # the same conversation goes on
                assert after.messages[: len(before.messages)] == before.messages
                assert after.messages[len(before.messages)][0] == "assistant"
                assert after.at - before.at == pytest.approx(2.0)
            else:  # a new conversation: the tenant's system prompt and a first question
                assert after.messages[0] == before.messages[0] and len(after.messages) == 2
    assert len(systems) == 3  # one per tenant, shared by its users
    first = arrivals[0]
    assert first.messages[0][0] == "system" and len(first.messages[0][1]) == 4 * 300
    rendered = len("system\n\n") + 4 * 300 + len("user\n\n") + 4 * 20  # role\ncontent\n
    assert first.prompt_tokens == -(-rendered // 4)
    assert scenario.nodes[0].emulator_flags()[-2:] == ["--kv-blocks", "500"]
    assert "--kv-blocks" not in parse_scenario(_valid()).nodes[0].emulator_flags()


def test_shared_and_rag_prompts() -> None:
    shared = load_scenario("shared-system-prompt").arrivals()
    assert len({a.messages[0] for a in shared}) == 1
    assert len({a.messages[1] for a in shared}) == len(shared)  # every question its own
    rag = load_scenario("rag")
    docs: dict[str, int] = {}
    for a in rag.arrivals():
        *carried, question = a.messages[1][1].split("\n\n")
        assert 1 <= len(carried) <= 3 and question
        for doc in carried:
            docs[doc] = docs.get(doc, 0) + 1
    assert len(docs) <= 40
    counts = sorted(docs.values(), reverse=True)
    assert counts[0] > 5 * counts[len(counts) // 2]  # Zipf: a few documents carry the most


def test_the_prefix_scenarios_load_with_their_shapes() -> None:
    chat = load_scenario("multi-tenant-chat")
    prompts = chat.workload.prompts
    assert prompts is not None and prompts.kind == "chat" and prompts.tenants >= 24
    assert all(n.kv_blocks > 0 and n.prefill_tokens_per_s > 0 for n in chat.nodes)
    assert chat.capacity() > 0


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"kind": "forum"}, "workload.prompts.kind"),
        ({"tenants": 0}, "workload.prompts.tenants"),
        ({"users": "many"}, "workload.prompts.users"),
        ({"think_ms": "long"}, "workload.prompts.think_ms"),
        ({"turns": {"dist": "pareto"}}, "workload.prompts.turns.dist"),
        ({"documents": 3}, "workload.prompts.documents"),  # a rag key on a chat
        ({"kind": "rag", "per_query": [2, 1]}, "workload.prompts.per_query"),
        ({"kind": "rag", "zipf": -1}, "workload.prompts.zipf"),
    ],
)
def test_bad_prompts_name_their_key(change: dict[str, Any], key: str) -> None:
    data = _chat()
    data["workload"]["prompts"].update(change)
    if change.get("kind") == "rag":
        for k in ("tenants", "users", "turns", "think_ms"):
            del data["workload"]["prompts"][k]
        data["workload"]["rate"] = 2
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == key


def test_a_chat_takes_no_rate_and_the_others_need_one() -> None:
    data = _chat()
    data["workload"]["rate"] = 3
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == "workload.rate"
    data = _chat()
    data["workload"]["prompts"] = {"kind": "shared"}
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == "workload.rate"
    data["workload"]["rate"] = 2
    assert parse_scenario(data).base_rate == 2
    data["workload"]["prompts"] = "chat"
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == "workload.prompts"
    data = _chat()
    data["nodes"][0]["kv_blocks"] = -1
    with pytest.raises(ConfigError) as err:
        parse_scenario(data)
    assert err.value.key == "nodes[0].kv_blocks"
