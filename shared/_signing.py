"""Snapshot signing (HMAC-SHA256 with a key id) and the freshness check.

The signature is the last entry of the map, ``"sig": bin(16)`` (HMAC-SHA256 truncated to 128
bits), and covers every byte before that
entry (map header included). A verifier therefore checks the exact bytes it received: no
re-encoding, so no canonical-form rules to get wrong, and verifying costs one HMAC.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import msgpack

from ._errors import SnapshotError
from ._snapshot import (
    MAX_SNAPSHOT_BYTES,
    SIG_BYTES,
    Snapshot,
    decode_unverified,
    encode_unsigned,
    pack,
)

__all__ = ["FreshnessCheck", "SigningKey", "decode", "encode", "load_key_file", "load_keys"]

_SIG_LEN = SIG_BYTES
_SIG_KEY: bytes = msgpack.packb("sig")
# msgpack "bin 8" header for the tag; together with the key, the fixed prefix of the sig entry.
_SIG_PREFIX = _SIG_KEY + b"\xc4" + bytes([_SIG_LEN])
_SIG_ENTRY_LEN = len(_SIG_PREFIX) + _SIG_LEN
_PLACEHOLDER = bytes(_SIG_LEN)
_MIN_SECRET = 16
# A key id travels in the clear in every snapshot: a token (visible ASCII, no ':'), so that a
# bare secret holding ':' and a space or a non-ASCII letter before it is refused, not cut in two.
_KID = re.compile(r"[!-9;-~]{1,128}")


@dataclass(frozen=True, slots=True)
class SigningKey:
    """A shared secret and the id that names it, so keys can be rotated without a flag day."""

    kid: str
    secret: bytes

    def __post_init__(self) -> None:
        if not _KID.fullmatch(self.kid):
            raise ValueError("signing key id must be 1..128 visible ASCII characters, no ':'")
        if len(self.secret) < _MIN_SECRET:
            raise ValueError(f"signing key {self.kid!r} must be at least {_MIN_SECRET} bytes")

    def __repr__(self) -> str:
        return f"SigningKey(kid={self.kid!r}, secret=<{len(self.secret)} bytes>)"


def load_key_file(path: str | Path) -> SigningKey:
    """Read ``KID:SECRET`` (or a bare ``SECRET``, key id ``default``) from the first line: the
    key a sidecar signs with."""
    return load_keys(path)[0]


def load_keys(path: str | Path) -> tuple[SigningKey, ...]:
    """Every key of the file, one ``KID:SECRET`` a line (or a bare ``SECRET`` on the only
    line, key id ``default``): what a gateway accepts. Rotation without a flag day: add the new
    key to the gateways' files, move the sidecars to it (their file's first line), then drop
    the old one; a gateway that held one key refused every sidecar on the other meanwhile."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read signing key file {str(path)!r}: {exc}") from None
    lines = [line.strip() for line in text if line.strip()]
    keys: dict[str, SigningKey] = {}
    for number, line in enumerate(lines or [""], 1):
        kid, sep, secret = line.partition(":")
        if not sep:
            if len(lines) > 1:
                raise ValueError(f"signing key file {str(path)!r}: one KID:SECRET a line")
            kid, secret = "default", line
        elif not _KID.fullmatch(kid.strip()):
            # Not echoed: a bare secret holding ':' would be cut in two, its head sent in the
            # clear as the key id of every snapshot.
            raise ValueError(
                f"signing key file {str(path)!r}, line {number}: not KID:SECRET (a key id is"
                " 1..128 visible ASCII characters; a bare secret cannot hold ':')"
            )
        key = SigningKey(kid.strip(), secret.strip().encode())
        if key.kid in keys:
            raise ValueError(f"signing key file {str(path)!r}: key id {key.kid!r} twice")
        keys[key.kid] = key
    return tuple(keys.values())


def encode(snapshot: Snapshot, key: SigningKey | None = None) -> bytes:
    """Encode a snapshot; with a key, stamp its id and sign it."""
    if key is None:
        if snapshot.kid is not None:
            snapshot = replace(snapshot, kid=None)
        return encode_unsigned(snapshot)
    wire = snapshot.to_wire()
    wire["kid"] = key.kid
    wire["sig"] = _PLACEHOLDER  # last key: dicts keep insertion order, so it is packed last
    data = pack(wire)
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"snapshot is {len(data)} bytes, over the {MAX_SNAPSHOT_BYTES} limit")
    body = data[:-_SIG_ENTRY_LEN]
    return data[:-_SIG_LEN] + hmac.digest(key.secret, body, hashlib.sha256)[:_SIG_LEN]


def decode(
    data: bytes | bytearray | memoryview, keys: Mapping[str, SigningKey] | None = None
) -> Snapshot:
    """Decode and validate a snapshot. With ``keys`` (by key id), it must be signed by one."""
    snapshot, raw = decode_unverified(data)
    if keys is None:
        return snapshot
    if snapshot.sig is None or snapshot.kid is None:
        raise SnapshotError("snapshot is not signed, and a signing key is configured")
    key = keys.get(snapshot.kid)
    if key is None:
        raise SnapshotError(f"snapshot is signed with unknown key id {snapshot.kid!r}")
    data = bytes(data)
    if data[-_SIG_ENTRY_LEN:-_SIG_LEN] != _SIG_PREFIX or raw.get("sig") is None:
        raise SnapshotError("snapshot signature must be the last map entry")
    expected = hmac.digest(key.secret, data[:-_SIG_ENTRY_LEN], hashlib.sha256)[:_SIG_LEN]
    if not hmac.compare_digest(expected, data[-_SIG_LEN:]):
        raise SnapshotError(f"snapshot signature does not verify with key {key.kid!r}")
    return snapshot


class FreshnessCheck:
    """Rejects snapshots older than ``window_s`` and replays within a boot.

    It remembers, per node, the newest ``(boot, seq, ts)`` accepted. A new boot id starts a
    new sequence; a ``seq`` that is not newer than the last one of the same boot is rejected,
    and so is another boot's snapshot not newer than the last one accepted: after a restart the
    old boot's snapshots, still inside the window, were taken again, and an interceptor could
    replay old and new in turn (the node flipping between ready and its real state).
    Timestamps more than ``window_s`` in the future are rejected too (a clock far ahead would
    otherwise make a snapshot immortal).
    """

    __slots__ = ("_gone", "_last", "window_s")

    def __init__(self, window_s: float = 10.0) -> None:
        if (
            isinstance(window_s, bool)
            or not isinstance(window_s, int | float)
            or not 0 < window_s <= 86_400
        ):
            raise ValueError(
                f"freshness window must be a number of seconds in (0, 86400]: {window_s!r}"
            )
        self.window_s = window_s
        self._last: dict[str, tuple[str, int, float]] = {}
        # Nodes forgotten while their last snapshot was inside the window: a node that leaves
        # and comes back (a DNS answer that left it out once) took one replay of it again.
        self._gone: dict[str, tuple[str, int, float]] = {}

    def __repr__(self) -> str:
        return f"FreshnessCheck(window_s={self.window_s!r})"

    def check(self, snapshot: Snapshot, now: float | None = None, *, again: bool = False) -> None:
        """``again``: the very snapshot last accepted for its node may pass once more (a node
        replaced at a reload, same sidecar, polls what its predecessor took: no replay, but it
        was refused, logged as one, and the node joined with no snapshot)."""
        now = time.time() if now is None else now
        age = now - snapshot.ts
        if age > self.window_s:
            raise SnapshotError(f"snapshot from {snapshot.node!r} is {age:.1f}s old")
        if age < -self.window_s:
            raise SnapshotError(f"snapshot from {snapshot.node!r} is {-age:.1f}s in the future")
        last = self._last.get(snapshot.node)
        if last is None:
            # (Taken out of `_gone` only once one passes: a refused one left no record.)
            last = self._gone.get(snapshot.node)
        if last is not None:
            if again and last[:2] == (snapshot.boot, snapshot.seq):
                self._gone.pop(snapshot.node, None)
                self._last[snapshot.node] = last
                return
            if last[0] == snapshot.boot and snapshot.seq <= last[1]:
                raise SnapshotError(
                    f"snapshot from {snapshot.node!r} has seq {snapshot.seq}, "
                    f"not newer than {last[1]} of boot {snapshot.boot!r}"
                )
            if last[0] != snapshot.boot and snapshot.ts <= last[2]:
                raise SnapshotError(
                    f"snapshot from {snapshot.node!r} of boot {snapshot.boot!r} is not newer "
                    f"than the last one accepted, of boot {last[0]!r}"
                )
        self._gone.pop(snapshot.node, None)
        self._last[snapshot.node] = (snapshot.boot, snapshot.seq, snapshot.ts)

    def forget(self, node: str, now: float | None = None) -> None:
        """``node`` left: what it sent goes once nothing of it could pass the window."""
        now = time.time() if now is None else now
        oldest = now - self.window_s
        last = self._last.pop(node, None)
        if last is not None and last[2] > oldest:
            self._gone[node] = last
        for name in [n for n, held in self._gone.items() if held[2] <= oldest]:
            del self._gone[name]
