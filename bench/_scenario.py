"""Benchmark scenarios: a TOML file of nodes (emulator parameters, faults over time) and a
workload (open-loop Poisson arrivals, a length mix, bursts). The live runner and the simulator
read the same objects, so both replay the same trace for the same seed."""
# Over 350 lines: the scenario model and its TOML parser, one concern; most of the length is key-
# by-key validation that names each key.

from __future__ import annotations

import dataclasses
import math
import random
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from promptlb.emulator._faults import MAX_LEAK_MB, MAX_SLOW, MIN_SLOW
from promptlb.shared import ConfigError, parse_duration

from ._prompts import Messages, Prompts, message_tokens, parse_prompts, prompted_arrivals

__all__ = [
    "RSS_WINDOW_S",
    "SLOW_FACTOR",
    "TARGET_KEYS",
    "Arrival",
    "Burst",
    "Dist",
    "Fault",
    "NodeSpec",
    "PromptClass",
    "Scenario",
    "Workload",
    "load_scenario",
    "scaled",
    "scenario_path",
]

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
# The default strategy's p99 over another's: round robin's (live runs and the simulator), the
# best LiteLLM router's (live runs) and the perfect-information bound's (the simulator).
TARGET_KEYS = (
    "p99_vs_round_robin",
    "p99_vs_best_litellm",
    "p99_vs_perfect",
    # Prompt-carrying scenarios: the default's TTFT p90 over round robin's, over its own under
    # [affinity] and over the oracle's; its prefix-cache hit rate over the oracle's (at least).
    "ttft_p90_vs_round_robin",
    "ttft_p90_vs_affinity",
    "ttft_p90_vs_oracle",
    "hit_rate_vs_oracle",
)
FaultKind = Literal["crash", "recover", "slow", "hang", "leak"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Dist:
    """A length distribution: ``fixed`` (mean), ``lognormal`` (mean and sigma: heavy-tailed),
    ``uniform`` (lo..hi). Draws are clipped to ``lo..hi``."""

    kind: Literal["fixed", "lognormal", "uniform"] = "fixed"
    mean: float = 64.0
    sigma: float = 0.0
    lo: int = 1
    hi: int = 8192

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.mean
        elif self.kind == "uniform":
            value = rng.uniform(self.lo, self.hi)
        else:
            mu = math.log(self.mean) - self.sigma**2 / 2  # keeps the mean
            value = rng.lognormvariate(mu, self.sigma)
        return max(self.lo, min(self.hi, round(value)))

    def expected(self) -> float:
        """The mean after clipping, estimated once with a fixed-seed sample."""
        if self.kind == "fixed":
            return float(max(self.lo, min(self.hi, round(self.mean))))
        rng = random.Random(0)
        return sum(self.draw(rng) for _ in range(4000)) / 4000


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptClass:
    name: str
    share: float
    prompt_tokens: Dist
    max_tokens: Dist


@dataclass(frozen=True, slots=True, kw_only=True)
class Burst:
    at: float
    duration: float
    factor: float  # multiplies the base rate while it lasts


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    rate: float | None = None  # requests per second, or ...
    load: float | None = None  # ... a share of the cluster's total capacity
    mix: tuple[PromptClass, ...] = ()
    bursts: tuple[Burst, ...] = ()
    # Arrivals that carry their prompt as messages (``_prompts``); None: lengths alone, as the
    # scenarios before it (their traces unchanged).
    prompts: Prompts | None = None


SLOW_FACTOR = 2.0  # a "slow" fault without a value, live and in the simulator alike
# The sidecars' RSS slope window in a run (their default is a minute): a run lasts about a
# minute and a scenario's leak a quarter of it (seed-3am: 15 s from its start to the crash).
# Over 60 s the fit would average the leak with the flat time before it and see it only
# halfway to the OOM, and one strategy's run would still weigh in the next one's window. The
# simulator's sidecars use it too (`_simleak`).
RSS_WINDOW_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    at: float
    kind: FaultKind
    value: float = 0.0  # slow: the factor (0: SLOW_FACTOR); leak: MB per request


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    name: str
    slots: int = 8
    tokens_per_s: float = 50.0
    ttft_ms: float = 100.0
    prefill_tokens_per_s: float = 0.0
    kv_blocks: int = 0  # the emulator's --kv-blocks; 0: its default (slots x 128)
    tier: str = ""
    tags: tuple[str, ...] = ()
    faults: tuple[Fault, ...] = ()
    # The model server's memory limit, for its sidecar's time-to-OOM (``--memory-limit-mb``);
    # None: the sidecar's default (the model's cgroup, else the host's available memory). The
    # emulator does not enforce it: a scenario scripts its crash as a fault.
    memory_limit_mb: int | None = None

    def capacity(self, mean_output: float, mean_input: float = 0.0) -> float:
        """Requests per second at full use: slots over the mean service time."""
        service = self.ttft_ms / 1000 + mean_output / self.tokens_per_s
        if self.prefill_tokens_per_s:
            service += mean_input / self.prefill_tokens_per_s
        return self.slots / service

    def emulator_flags(self) -> list[str]:
        return [
            "--slots",
            str(self.slots),
            "--tokens-per-s",
            str(self.tokens_per_s),
            "--ttft-ms",
            str(self.ttft_ms),
            "--prefill-tokens-per-s",
            str(self.prefill_tokens_per_s),
            # Only when set, so that the scenarios from before it start the same emulators.
            *(["--kv-blocks", str(self.kv_blocks)] if self.kv_blocks else []),
        ]


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds from the start
    prompt_class: str
    prompt_tokens: int
    max_tokens: int
    messages: Messages = ()  # the prompt itself, when the workload has prompts
    session: str = ""  # the conversation it belongs to (chat), for reports


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    duration: float
    seed: int
    model: str = "bench"
    nodes: tuple[NodeSpec, ...]
    workload: Workload
    description: str = ""
    # Per strategy name, the options both the simulator and the live gateways build it with
    # (``[strategy_options.model_aware]``: its routes for this scenario's node tags).
    strategy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The project's targets for the default strategy on this scenario (``[targets]``), by
    # name in TARGET_KEYS: reported next to the numbers, never tuned to.
    targets: dict[str, float] = field(default_factory=dict)
    _rate: float = field(default=0.0, repr=False, compare=False)
    _means: tuple[float, float] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Under ``load`` the rate follows an estimated capacity (thousands of draws): work it
        # out once here, not for every arrival.
        prompts = self.workload.prompts
        if prompts is not None and prompts.kind == "chat":
            rate = prompts.mean_rate()  # the users' pace sets it
        elif self.workload.rate is not None:
            rate = self.workload.rate
        else:
            assert self.workload.load is not None
            rate = self.workload.load * self.capacity()
        object.__setattr__(self, "_rate", rate)

    @property
    def base_rate(self) -> float:
        """Requests per second before bursts."""
        return self._rate

    def capacity(self) -> float:
        """Requests per second at full use, every prompt token prefilled (no cache hit)."""
        if self.workload.prompts is not None:
            mean_out, mean_in = self._prompt_means()
        else:
            mean_out = sum(c.share * c.max_tokens.expected() for c in self.workload.mix)
            mean_in = sum(c.share * c.prompt_tokens.expected() for c in self.workload.mix)
        return sum(n.capacity(mean_out, mean_in) for n in self.nodes)

    def _prompt_means(self) -> tuple[float, float]:
        """Mean output and prompt tokens of the trace itself (drawn once)."""
        if self._means is None:
            trace = self.arrivals()
            n = max(1, len(trace))
            means = (sum(a.max_tokens for a in trace) / n, sum(a.prompt_tokens for a in trace) / n)
            object.__setattr__(self, "_means", means)
        assert self._means is not None
        return self._means

    def rate_at(self, t: float) -> float:
        rate = self.base_rate
        for burst in self.workload.bursts:
            if burst.at <= t < burst.at + burst.duration:
                rate *= burst.factor
        return rate

    def arrivals(self, seed: int | None = None) -> list[Arrival]:
        """The open-loop Poisson trace: the same for the same seed, whoever replays it.

        A piecewise-constant rate (bursts) is handled by thinning against the peak rate."""
        rng = random.Random(self.seed if seed is None else seed)
        prompts = self.workload.prompts
        if prompts is not None:
            return [
                Arrival(at, cls, message_tokens(messages), max_tokens, messages, session)
                for at, cls, messages, max_tokens, session in prompted_arrivals(
                    prompts, rng, self.duration, self.base_rate
                )
            ]
        # The rate's most, where it may change (a burst's start or end): overlapping bursts
        # multiply (a peak of the largest one alone thinned them to under half their rate),
        # and a lull's end inside a burst raises it.
        changes = [t for b in self.workload.bursts for t in (b.at, b.at + b.duration)]
        peak = max([self.base_rate] + [self.rate_at(t) for t in changes])
        shares = [c.share for c in self.workload.mix]
        out: list[Arrival] = []
        t = 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= self.duration:
                return out
            if rng.random() * peak > self.rate_at(t):
                continue
            cls = rng.choices(self.workload.mix, weights=shares)[0]
            out.append(Arrival(t, cls.name, cls.prompt_tokens.draw(rng), cls.max_tokens.draw(rng)))


def scaled(scenario: Scenario, duration: float) -> tuple[Scenario, float]:
    """The scenario over ``duration``: fault and burst times scaled with it, so that a shorter
    run still plays the whole story (a crash at 30 s of 60 s happens at 15 s of 30 s). Returns
    the scenario and the scale."""
    scale = duration / scenario.duration
    if scale == 1.0:
        return scenario, 1.0
    nodes = tuple(
        dataclasses.replace(
            n, faults=tuple(dataclasses.replace(f, at=f.at * scale) for f in n.faults)
        )
        for n in scenario.nodes
    )
    bursts = tuple(
        Burst(at=b.at * scale, duration=b.duration * scale, factor=b.factor)
        for b in scenario.workload.bursts
    )
    workload = dataclasses.replace(scenario.workload, bursts=bursts)
    return dataclasses.replace(scenario, duration=duration, nodes=nodes, workload=workload), scale


def scenario_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return path
    return SCENARIOS / f"{name_or_path}.toml"


def load_scenario(name_or_path: str) -> Scenario:
    """A scenario by name (``bench/scenarios/NAME.toml``) or path; errors name the key."""
    path = scenario_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("scenario", str(path), f"a readable TOML file ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("scenario", str(path), f"valid TOML ({exc})") from None
    return parse_scenario(data, default_name=path.stem)


def _get(
    data: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    if key not in data:
        if default is ...:
            raise ConfigError(f"{where}{key}", None, "a value (it is required)")
        return default
    value = data[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(f"{where}{key}", value, f"a {kind}")
    if not isinstance(value, kind):
        raise ConfigError(f"{where}{key}", value, f"a value of type {kind}")
    return value


_NODE_KEYS = frozenset(
    {
        "name",
        "count",
        "slots",
        "tokens_per_s",
        "ttft_ms",
        "prefill_tokens_per_s",
        "kv_blocks",
        "tier",
        "tags",
        "faults",
        "memory_limit_mb",
    }
)


def _only(raw: object, keys: frozenset[str] | set[str], where: str) -> dict[str, Any]:
    """``raw`` as a table holding none but ``keys``: a misspelt key (``slot = 1``) was the
    default, silently, where the top level's refused one."""
    if not isinstance(raw, dict):
        raise ConfigError(where.rstrip("."), raw, "a table")
    for key in raw:
        if key not in keys:
            raise ConfigError(f"{where}{key}", raw[key], "one of " + ", ".join(sorted(keys)))
    return raw


def _tables(raw: dict[str, Any], key: str, where: str, keys: set[str]) -> list[dict[str, Any]]:
    """The list of tables at ``key``, each holding none but ``keys`` (`_only`)."""
    return [
        _only(item, keys, f"{where}{key}[{i}].")
        for i, item in enumerate(_get(raw, key, where, list, []))
    ]


def _positive(key: str, value: float, *, zero: bool = False) -> float:
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer past a float's range (TOML takes them)
        finite = False
    if not finite or value < 0 or (value == 0 and not zero):
        raise ConfigError(key, value, ">= 0" if zero else "> 0")
    return float(value)


def _dist(raw: Any, where: str) -> Dist:
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return Dist(kind="fixed", mean=_positive(where, raw))
    if not isinstance(raw, dict):
        raise ConfigError(where, raw, "a number or a table {dist, mean, sigma, lo, hi}")
    _only(raw, {"dist", "mean", "sigma", "lo", "hi"}, f"{where}.")
    kind = raw.get("dist", "lognormal")
    if kind not in ("fixed", "lognormal", "uniform"):
        raise ConfigError(f"{where}.dist", kind, "fixed, lognormal or uniform")
    lo = int(_get(raw, "lo", f"{where}.", int, 1))
    hi = int(_get(raw, "hi", f"{where}.", int, 8192))
    if not 1 <= lo <= hi:
        raise ConfigError(f"{where}.lo", lo, "1 <= lo <= hi")
    return Dist(
        kind=kind,
        mean=_positive(f"{where}.mean", _get(raw, "mean", f"{where}.", (int, float), 64.0)),
        sigma=_positive(
            f"{where}.sigma", _get(raw, "sigma", f"{where}.", (int, float), 0.0), zero=True
        ),
        lo=lo,
        hi=hi,
    )


def parse_scenario(data: dict[str, Any], default_name: str = "scenario") -> Scenario:
    known = {
        "name",
        "description",
        "duration",
        "seed",
        "model",
        "nodes",
        "workload",
        "strategy_options",
        "targets",
    }
    for key in data:
        if key not in known:
            raise ConfigError(key, data[key], "one of " + ", ".join(sorted(known)))
    duration = parse_duration("duration", data.get("duration", "60s"))
    if duration <= 0:
        raise ConfigError("duration", data.get("duration"), "> 0")
    raw_nodes = _get(data, "nodes", "", list)
    nodes: list[NodeSpec] = []
    for i, raw in enumerate(raw_nodes):
        where = f"nodes[{i}]."
        raw = _only(raw, _NODE_KEYS, where)
        count = _get(raw, "count", where, int, 1)
        faults = tuple(
            Fault(
                at=parse_duration(f"{where}faults[{j}].at", f.get("at", 0)),
                kind=_fault_kind(f.get("kind"), f"{where}faults[{j}].kind"),
                value=_fault_value(f, f"{where}faults[{j}]."),
            )
            for j, f in enumerate(_tables(raw, "faults", where, {"at", "kind", "value"}))
        )
        base = _get(raw, "name", where, str)
        for k in range(count):
            nodes.append(
                NodeSpec(
                    name=base if count == 1 else f"{base}-{k + 1}",
                    slots=_at_least_one(f"{where}slots", _get(raw, "slots", where, int, 8)),
                    tokens_per_s=_positive(
                        f"{where}tokens_per_s", _get(raw, "tokens_per_s", where, (int, float), 50.0)
                    ),
                    ttft_ms=_positive(
                        f"{where}ttft_ms",
                        _get(raw, "ttft_ms", where, (int, float), 100.0),
                        zero=True,
                    ),
                    prefill_tokens_per_s=_positive(
                        f"{where}prefill_tokens_per_s",
                        _get(raw, "prefill_tokens_per_s", where, (int, float), 0.0),
                        zero=True,
                    ),
                    kv_blocks=_kv_blocks(_get(raw, "kv_blocks", where, int, 0), where),
                    tier=_get(raw, "tier", where, str, ""),
                    tags=tuple(_get(raw, "tags", where, list, [])),
                    faults=faults,
                    memory_limit_mb=_memory_limit(
                        _get(raw, "memory_limit_mb", where, int, None), where
                    ),
                )
            )
    if not nodes:
        raise ConfigError("nodes", [], "at least one [[nodes]] table")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ConfigError("nodes", names, "unique node names")
    raw_work = _only(
        _get(data, "workload", "", dict), {"rate", "load", "prompts", "mix", "bursts"}, "workload."
    )
    rate = _get(raw_work, "rate", "workload.", (int, float), None)
    load = _get(raw_work, "load", "workload.", (int, float), None)
    raw_prompts = raw_work.get("prompts")
    prompts = None if raw_prompts is None else parse_prompts(raw_prompts, _dist)
    if prompts is not None and prompts.kind == "chat":
        # The users' think time sets the pace: a rate or load would say something else.
        if rate is not None or load is not None:
            key = "workload.rate" if rate is not None else "workload.load"
            raise ConfigError(key, rate or load, "nothing: a chat's pace is its users' think time")
    elif prompts is not None and (rate is None or load is not None):
        # Its capacity depends on its own trace: a rate it is, not a share of capacity.
        raise ConfigError("workload.rate", rate, "a rate (req/s), and no load, with prompts")
    elif (rate is None) == (load is None):
        raise ConfigError("workload", raw_work, "exactly one of rate (req/s) or load (0..2)")
    if rate is not None:
        _positive("workload.rate", rate)
    if load is not None and not 0 < load <= 2:
        raise ConfigError("workload.load", load, "a share of capacity in (0, 2]")
    mix = tuple(
        PromptClass(
            name=_get(c, "name", f"workload.mix[{i}].", str),
            share=_positive(
                f"workload.mix[{i}].share",
                _get(c, "share", f"workload.mix[{i}].", (int, float), 1.0),
            ),
            prompt_tokens=_dist(c.get("prompt_tokens", 64), f"workload.mix[{i}].prompt_tokens"),
            max_tokens=_dist(c.get("max_tokens", 64), f"workload.mix[{i}].max_tokens"),
        )
        for i, c in enumerate(
            _tables(raw_work, "mix", "workload.", {"name", "share", "prompt_tokens", "max_tokens"})
            if "mix" in raw_work
            else [{"name": "default"}]
        )
    )
    bursts = tuple(
        Burst(
            at=parse_duration(f"workload.bursts[{i}].at", b.get("at", 0)),
            duration=parse_duration(f"workload.bursts[{i}].duration", b.get("duration", 0)),
            factor=_positive(f"workload.bursts[{i}].factor", b.get("factor", 1.0)),
        )
        for i, b in enumerate(
            _tables(raw_work, "bursts", "workload.", {"at", "duration", "factor"})
        )
    )
    options = _get(data, "strategy_options", "", dict, {})
    for key, value in options.items():
        if not isinstance(value, dict):
            raise ConfigError(
                f"strategy_options.{key}", value, "a table of that strategy's options"
            )
    targets = _get(data, "targets", "", dict, {})
    for key, value in targets.items():
        if key not in TARGET_KEYS:
            raise ConfigError(f"targets.{key}", value, "one of " + ", ".join(TARGET_KEYS))
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value < math.inf
        ):
            raise ConfigError(f"targets.{key}", value, "a finite ratio > 0")
    return Scenario(
        strategy_options=options,
        targets={k: float(v) for k, v in targets.items()},
        name=_get(data, "name", "", str, default_name),
        description=_get(data, "description", "", str, ""),
        duration=duration,
        seed=_get(data, "seed", "", int, 1),
        model=_get(data, "model", "", str, "bench"),
        nodes=tuple(nodes),
        workload=Workload(
            rate=None if rate is None else float(rate),
            load=None if load is None else float(load),
            mix=mix,
            bursts=bursts,
            prompts=prompts,
        ),
    )


def _kv_blocks(value: int, where: str) -> int:
    if value < 0:
        raise ConfigError(f"{where}kv_blocks", value, "blocks of 16 tokens, >= 0 (0: the default)")
    return value


def _memory_limit(value: int | None, where: str) -> int | None:
    if value is not None and value < 1:
        raise ConfigError(f"{where}memory_limit_mb", value, "megabytes, >= 1 (or left out)")
    return value


def _fault_value(raw: dict[str, Any], where: str) -> float:
    """A fault's ``value``, checked as the emulator checks it: a live run whose emulator
    refused a value (a negative or NaN slow factor, a leak past its bound) ran without that
    fault while the simulator applied it."""
    kind = raw.get("kind")
    if "value" not in raw:
        return 0.0
    value = _get(raw, "value", where, (int, float))
    if kind not in ("slow", "leak"):
        raise ConfigError(f"{where}value", value, f"no value: a {kind} fault takes none")
    number = _positive(f"{where}value", value, zero=True)
    if kind == "leak" and number > MAX_LEAK_MB:
        raise ConfigError(f"{where}value", value, f"MB per request in 0..{MAX_LEAK_MB}")
    if kind == "slow" and number and not MIN_SLOW <= number <= MAX_SLOW:  # 0: the default
        raise ConfigError(f"{where}value", value, f"a factor in {MIN_SLOW:g}..{MAX_SLOW:g}")
    return number


def _at_least_one(key: str, value: int) -> int:
    if value < 1:
        raise ConfigError(key, value, ">= 1")
    return value


def _fault_kind(value: object, where: str) -> FaultKind:
    if value not in ("crash", "recover", "slow", "hang", "leak"):
        raise ConfigError(where, value, "crash, recover, slow, hang or leak")
    return value
