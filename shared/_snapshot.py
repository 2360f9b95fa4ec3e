"""Load snapshot schema v1 and its msgpack codec.

The wire form is one msgpack map (see docs/design.md, "Wire format"). Readers are forward
compatible: unknown keys are ignored, missing optional keys take their defaults, and ``v`` may be
higher than 1. Every value is type- and range-checked when a `Snapshot` is built, so a decoded
snapshot is as trustworthy as one built in process.
"""
# Over 350 lines: the wire format, one concern: the schema, its validation (a fast path and a slow
# one that names the field) and the codec.

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import msgpack

from ._errors import SnapshotError

__all__ = [
    "EPOCHS_V",
    "MAX_AGE_MS",
    "MAX_COUNT",
    "MAX_NAMES",
    "MAX_NAME_CHARS",
    "MAX_SNAPSHOT_BYTES",
    "MAX_TPS",
    "SCHEMA_VERSION",
    "SEQ_EPOCH_BITS",
    "SIG_BYTES",
    "EngineSample",
    "GpuSample",
    "Snapshot",
    "decode_unverified",
    "encode_unsigned",
    "pack",
]

SCHEMA_VERSION = 1
# From ``v`` 2 a writer's ``seq`` starts a new epoch (its bits above the lowest
# `SEQ_EPOCH_BITS`) with every new engine reading, and counts up within one for other news: a
# reader tells a reading sent again from a new one at no byte's cost (a field of its own put
# the benchmark's 8-GPU signed snapshot over its 512 bytes). Readers of v1 only order by seq.
EPOCHS_V = 2
SEQ_EPOCH_BITS = 8
MAX_SNAPSHOT_BYTES = 64 * 1024
# HMAC-SHA256 truncated to 128 bits (as IPsec's HMAC-SHA-256-128, RFC 4868): ample against
# forgery within a freshness window of seconds, and 16 bytes less in every snapshot.
SIG_BYTES = 16

_MAX_NAME = 253  # a DNS name: node names are usually host names
_MAX_LABEL = 128
# Models and tags: up to 64 of each, of up to 256 characters (vLLM's model id is often a path).
MAX_NAMES = 64
MAX_NAME_CHARS = 256
_MAX_GPUS = 64
_MAX_INT = 2**63 - 1
MAX_TPS = 1e9
MAX_COUNT = 2**53  # counts beyond this are nonsense, and lose precision as floats
MAX_AGE_MS = 86_400_000  # a day: a reading older than that is a writer's bug

# msgpack's own limits, well above anything valid and far below anything harmful.
_UNPACK_LIMITS: dict[str, int] = {
    "max_str_len": 4096,
    "max_bin_len": 256,
    "max_array_len": 256,
    "max_map_len": 64,
    "max_ext_len": 0,
}


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 3, 40, 40


def _bad(key: str, value: object, expected: str) -> SnapshotError:
    # reprlib bounds depth and length: a hostile 1,000-level nesting must not recurse.
    text = _repr.repr(value)
    return SnapshotError(f"snapshot field {key!r}: got {text}, expected {expected}")


def _int(key: str, value: object, lo: int = 0, hi: int = MAX_COUNT) -> int:
    # bool is an int subclass; a bool where a count belongs is a writer bug, not a count.
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(key, value, f"an integer in {lo}..{hi}")
    return value


def _float(key: str, value: object, lo: float = -math.inf, hi: float = math.inf) -> float:
    if type(value) is not float and type(value) is not int:
        raise _bad(key, value, "a number")
    # Ints stay ints: NVML's whole degrees and watts then pack in 1-3 bytes, not 9. An int
    # beyond msgpack's 64 bits could neither be packed nor tested with isfinite.
    if type(value) is int and not -_MAX_INT <= value <= _MAX_INT:
        raise _bad(key, value, f"a finite number in {lo:g}..{hi:g}")
    if not lo <= value <= hi or not math.isfinite(value):
        raise _bad(key, value, f"a finite number in {lo:g}..{hi:g}")
    return value


def _opt_float(
    key: str, value: object, lo: float = -math.inf, hi: float = math.inf
) -> float | None:
    return None if value is None else _float(key, value, lo, hi)


def _str(key: str, value: object, max_len: int, *, empty: bool = True) -> str:
    if type(value) is not str or len(value) > max_len or (not empty and not value):
        size = f"1..{max_len}" if not empty else f"at most {max_len}"
        raise _bad(key, value, f"a string of {size} characters")
    return value


def _strs(key: str, value: object) -> tuple[str, ...]:
    if type(value) is not tuple and type(value) is not list:
        raise _bad(key, value, f"a list of at most {MAX_NAMES} strings")
    if len(value) > MAX_NAMES:
        raise _bad(key, value, f"a list of at most {MAX_NAMES} strings")
    return tuple(_str(key, item, MAX_NAME_CHARS, empty=False) for item in value)


def _all_labels(values: tuple[object, ...]) -> bool:
    return len(values) <= MAX_NAMES and all(
        type(v) is str and 0 < len(v) <= MAX_NAME_CHARS for v in values
    )


def _bool(key: str, value: object) -> bool:
    if type(value) is not bool:
        raise _bad(key, value, "true or false")
    return value


class GpuSample(NamedTuple):
    """One GPU. On the wire it is a positional array, which keeps an 8-GPU snapshot small.

    Memory is in MiB. Later schema versions may append fields; readers ignore them.
    """

    i: int
    util: float | None  # None: NVML has none for the card (one in MIG mode)
    mem_used: int
    mem_total: int
    temp_c: float | None = None
    power_w: float | None = None

    @classmethod
    def checked(cls, raw: object) -> GpuSample:
        """Validate a wire array (or a GpuSample); a snapshot carries up to 64 of these, so the
        common, valid case is checked in one expression and only a failure pays for a message."""
        kind = type(raw)
        if kind is cls:
            raw = tuple(raw)  # type: ignore[arg-type]
            kind = tuple
        # (Up to a wire array's most: later writers may append, and readers ignore the rest.)
        if (kind is list or kind is tuple) and 4 <= len(raw) <= 256:  # type: ignore[arg-type]
            if len(raw) == 6:  # type: ignore[arg-type]
                i, util, used, total, temp, power = raw  # type: ignore[misc]
            else:
                i, util, used, total, temp, power = (*raw[:6], None, None)[:6]  # type: ignore[index]
            if (
                type(i) is int
                and 0 <= i <= 4096
                and (
                    util is None or ((type(util) is float or type(util) is int) and 0 <= util <= 1)
                )
                and type(used) is int
                and 0 <= used <= MAX_COUNT
                and type(total) is int
                and 0 <= total <= MAX_COUNT
                and (
                    temp is None
                    or ((type(temp) is float or type(temp) is int) and -100 <= temp <= 200)
                )
                and (
                    power is None
                    or ((type(power) is float or type(power) is int) and 0 <= power <= 100_000)
                )
            ):
                # _make skips NamedTuple's Python-level __new__: this runs 8x per snapshot.
                return cls._make((i, util, used, total, temp, power))
            _int("gpus.i", i, 0, 4096)
            _opt_float("gpus.util", util, 0.0, 1.0)
            _int("gpus.mem_used", used)
            _int("gpus.mem_total", total)
            _opt_float("gpus.temp_c", temp, -100.0, 200.0)
            _opt_float("gpus.power_w", power, 0.0, 100_000.0)
        raise _bad("gpus", raw, "[i, util, mem_used, mem_total, temp_c?, power_w?]")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSample:
    """The model engine's own view of its load, from its /metrics."""

    running: int
    waiting: int
    kv_cache: float | None = None
    tps: float | None = None
    # The KV cache's capacity in tokens (vLLM: its blocks times their size; SGLang: its token
    # pool): what a router's index of cached prefixes can hold for this node.
    kv_tokens: int | None = None
    # How old the reading was when the snapshot was made, in whole milliseconds: a sidecar
    # keeps its last reading through a late or failed scrape (a busy engine answers /metrics
    # late), and a reader that asks "was this read after X?" needs to know. 0 from a writer
    # that does not say.
    age_ms: int = 0

    def __post_init__(self) -> None:
        kv, tps, cap = self.kv_cache, self.tps, self.kv_tokens
        if (
            type(self.running) is int
            and 0 <= self.running <= MAX_COUNT
            and type(self.waiting) is int
            and 0 <= self.waiting <= MAX_COUNT
            and (kv is None or ((type(kv) is float or type(kv) is int) and 0 <= kv <= 1))
            and (tps is None or ((type(tps) is float or type(tps) is int) and 0 <= tps <= MAX_TPS))
            and (cap is None or (type(cap) is int and 1 <= cap <= MAX_COUNT))
            and type(self.age_ms) is int
            and 0 <= self.age_ms <= MAX_AGE_MS
        ):
            return
        _int("engine.running", self.running)
        _int("engine.waiting", self.waiting)
        _opt_float("engine.kv_cache", self.kv_cache, 0.0, 1.0)
        _opt_float("engine.tps", self.tps, 0.0, MAX_TPS)
        if cap is not None:
            _int("engine.kv_tokens", cap, 1)
        _int("engine.age_ms", self.age_ms, 0, MAX_AGE_MS)

    @classmethod
    def checked(cls, raw: object) -> EngineSample:
        if isinstance(raw, EngineSample):
            return raw
        if not isinstance(raw, Mapping):
            raise _bad(
                "engine", raw, "a map {running, waiting, kv_cache?, tps?, kv_tokens?, age_ms?}"
            )
        try:
            return cls(
                running=raw["running"],
                waiting=raw["waiting"],
                kv_cache=raw.get("kv_cache"),
                tps=raw.get("tps"),
                kv_tokens=raw.get("kv_tokens"),
                age_ms=raw.get("age_ms", 0),
            )
        except KeyError as exc:
            raise SnapshotError(f"snapshot field 'engine.{exc.args[0]}' is missing") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """A node's load and state at one instant, as a sidecar reports it (schema v1).

    Load fields that the sidecar could not measure are ``None``: unknown, never zero.
    """

    node: str
    boot: str
    seq: int
    ts: float
    v: int = SCHEMA_VERSION
    ready: bool = False
    warm: bool = False
    draining: bool = False
    models: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    tier: str = ""
    cpu: float | None = None
    mem: float | None = None
    gpus: tuple[GpuSample, ...] = ()
    engine: EngineSample | None = None
    rss: int | None = None
    rss_slope: float | None = None
    # Bytes the model server may still take before its limit (its cgroup's, else the host's
    # available memory): with ``rss_slope``, the time left before a leak kills it.
    mem_free: int | None = None
    kid: str | None = None
    sig: bytes | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Lists become tuples, so that a snapshot is immutable all the way down.
        put = object.__setattr__
        for key in ("models", "tags"):
            value = getattr(self, key)
            if type(value) is not tuple or not _all_labels(value):
                put(self, key, _strs(key, value))
        gpus: object = self.gpus
        if (type(gpus) is not tuple and type(gpus) is not list) or len(gpus) > _MAX_GPUS:
            raise _bad("gpus", gpus, f"a list of at most {_MAX_GPUS} GPUs")
        if gpus:
            put(self, "gpus", tuple([GpuSample.checked(g) for g in gpus]))
        elif type(gpus) is list:  # ([]: a mutable list in a frozen snapshot, unhashable)
            put(self, "gpus", ())
        if self.engine is not None and type(self.engine) is not EngineSample:
            put(self, "engine", EngineSample.checked(self.engine))
        # The common, valid case in one expression; only a failure pays for finding which field.
        cpu, mem, slope, ts = self.cpu, self.mem, self.rss_slope, self.ts
        if (
            type(self.v) is int
            and 1 <= self.v <= 2**31
            and type(self.node) is str
            and 0 < len(self.node) <= _MAX_NAME
            and type(self.boot) is str
            and 0 < len(self.boot) <= _MAX_LABEL
            and type(self.seq) is int
            and 0 <= self.seq <= 2**63
            and type(ts) is float
            and 0.0 <= ts < math.inf
            and type(self.ready) is bool
            and type(self.warm) is bool
            and type(self.draining) is bool
            and type(self.tier) is str
            and len(self.tier) <= _MAX_LABEL
            and (cpu is None or (type(cpu) is float and 0.0 <= cpu <= 1.0))
            and (mem is None or (type(mem) is float and 0.0 <= mem <= 1.0))
            and (self.rss is None or (type(self.rss) is int and 0 <= self.rss <= MAX_COUNT))
            and (slope is None or (type(slope) is float and math.isfinite(slope)))
            and (
                self.mem_free is None
                or (type(self.mem_free) is int and 0 <= self.mem_free <= MAX_COUNT)
            )
            and (self.kid is None or (type(self.kid) is str and 0 < len(self.kid) <= _MAX_LABEL))
            and (self.sig is None or (type(self.sig) is bytes and len(self.sig) == SIG_BYTES))
        ):
            return
        self._check_slowly()

    def _check_slowly(self) -> None:
        put = object.__setattr__
        _int("v", self.v, 1, 2**31)
        _str("node", self.node, _MAX_NAME, empty=False)
        _str("boot", self.boot, _MAX_LABEL, empty=False)
        _int("seq", self.seq, 0, 2**63)
        put(self, "ts", float(_float("ts", self.ts, 0.0)))
        _bool("ready", self.ready)
        _bool("warm", self.warm)
        _bool("draining", self.draining)
        _str("tier", self.tier, _MAX_LABEL)
        if self.cpu is not None:
            put(self, "cpu", float(_float("cpu", self.cpu, 0.0, 1.0)))
        if self.mem is not None:
            put(self, "mem", float(_float("mem", self.mem, 0.0, 1.0)))
        if self.rss is not None:
            _int("rss", self.rss)
        if self.rss_slope is not None:
            put(self, "rss_slope", float(_float("rss_slope", self.rss_slope)))
        if self.mem_free is not None:
            _int("mem_free", self.mem_free)
        if self.kid is not None:
            _str("kid", self.kid, _MAX_LABEL, empty=False)
        if self.sig is not None and (type(self.sig) is not bytes or len(self.sig) != SIG_BYTES):
            raise _bad("sig", self.sig, f"{SIG_BYTES} bytes")

    def seconds_to_oom(self) -> float | None:
        """At the current slope, seconds until the model server has no memory left; None
        when it is not growing or either reading is missing."""
        slope, free = self.rss_slope, self.mem_free
        if slope is None or free is None or slope <= 0.0:
            return None
        return free / slope

    def same_reading(self, other: Snapshot | None) -> bool:
        """Whether ``other``, of the same sidecar boot, carries this snapshot's engine reading
        (sent again with the other collectors' news: a busy engine's late /metrics keeps it).
        A writer of `EPOCHS_V` or later starts a new seq epoch (``seq >> SEQ_EPOCH_BITS``) with
        every new reading; before it, every snapshot is a new reading."""
        if other is None or other.boot != self.boot or min(self.v, other.v) < EPOCHS_V:
            return False
        return (
            self.engine is not None
            and other.engine is not None
            and self.seq >> SEQ_EPOCH_BITS == other.seq >> SEQ_EPOCH_BITS
        )

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map, without ``sig``."""
        wire: dict[str, Any] = {
            "v": self.v,
            "node": self.node,
            "boot": self.boot,
            "seq": self.seq,
            "ts": self.ts,
            "ready": self.ready,
            "warm": self.warm,
        }
        # Defaults are left out: a reader fills them in, and every byte counts at 1 Hz x nodes.
        if self.draining:
            wire["draining"] = True
        if self.models:
            wire["models"] = self.models
        if self.tags:
            wire["tags"] = self.tags
        if self.tier:
            wire["tier"] = self.tier
        if self.cpu is not None:
            wire["cpu"] = self.cpu
        if self.mem is not None:
            wire["mem"] = self.mem
        if self.rss is not None:
            wire["rss"] = self.rss
        if self.rss_slope is not None:
            wire["rss_slope"] = self.rss_slope
        if self.mem_free is not None:
            wire["mem_free"] = self.mem_free
        if self.kid is not None:
            wire["kid"] = self.kid
        if self.gpus:
            wire["gpus"] = self.gpus
        if self.engine is not None:
            engine = self.engine
            wire["engine"] = {"running": engine.running, "waiting": engine.waiting}
            if engine.kv_cache is not None:
                wire["engine"]["kv_cache"] = engine.kv_cache
            if engine.tps is not None:
                wire["engine"]["tps"] = engine.tps
            if engine.kv_tokens is not None:
                wire["engine"]["kv_tokens"] = engine.kv_tokens
            if engine.age_ms:
                wire["engine"]["age_ms"] = engine.age_ms
        return wire

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any]) -> Snapshot:
        """Build from a decoded map: unknown keys ignored, optional keys defaulted."""
        missing = _REQUIRED - raw.keys()
        if missing:
            raise SnapshotError(f"snapshot field {sorted(missing)[0]!r} is missing")
        if raw.keys() <= _FIELDS:
            return cls(**raw)  # the common case: a v1 writer, keys exactly ours
        return cls(**{k: v for k, v in raw.items() if k in _FIELDS})


_FIELDS = frozenset(f.name for f in fields(Snapshot))
_REQUIRED = frozenset(("node", "boot", "seq", "ts"))


def pack(wire: dict[str, Any]) -> bytes:
    """msgpack, with the few failures validation cannot see (a lone surrogate in a string)
    reported as `SnapshotError`."""
    try:
        data: bytes = msgpack.packb(wire, use_bin_type=True)
    except (UnicodeEncodeError, OverflowError, ValueError, TypeError) as exc:
        raise SnapshotError(f"snapshot cannot be encoded: {type(exc).__name__}: {exc}") from None
    return data


def encode_unsigned(snapshot: Snapshot) -> bytes:
    data = pack(snapshot.to_wire())
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"snapshot is {len(data)} bytes, over the {MAX_SNAPSHOT_BYTES} limit")
    return data


def decode_unverified(data: bytes | bytearray | memoryview) -> tuple[Snapshot, dict[str, Any]]:
    """Decode and validate, without looking at the signature. Returns the raw map too."""
    if type(data) is not bytes and type(data) is not bytearray and type(data) is not memoryview:
        raise SnapshotError(f"snapshot must be bytes, got {type(data).__name__}")
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"snapshot is {len(data)} bytes, over the {MAX_SNAPSHOT_BYTES} limit")
    try:
        # use_list=False: arrays arrive as the tuples a Snapshot keeps, with no copy to make.
        raw = msgpack.unpackb(
            data, raw=False, use_list=False, strict_map_key=True, **_UNPACK_LIMITS
        )
    except Exception as exc:  # msgpack raises a zoo of types for bad input; all mean "not msgpack"
        raise SnapshotError(f"snapshot is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if type(raw) is not dict:
        raise SnapshotError(f"snapshot must be a msgpack map, got {type(raw).__name__}")
    return Snapshot.from_wire(raw), raw
