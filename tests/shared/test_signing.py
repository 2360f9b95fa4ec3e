"""Snapshot signing (HMAC-SHA256 with a key id), signing keys, key files, the freshness check."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from promptlb.shared import (
    EngineSample,
    FreshnessCheck,
    GpuSample,
    SigningKey,
    Snapshot,
    SnapshotError,
    decode,
    encode,
    load_key_file,
    load_keys,
)

SECRET = b"0123456789abcdef"
KEY = SigningKey("k1", SECRET)
KEYS = {KEY.kid: KEY}
NOW = 1_700_000_000.0


# Not a fixture: SIG_LEN and full() need it at import, and its ts is the NOW freshness checks use.
def snap(**fields: Any) -> Snapshot:
    base: dict[str, Any] = {"node": "node-a", "boot": "boot-1", "seq": 7, "ts": NOW}
    return Snapshot(**{**base, **fields})


def full() -> Snapshot:
    return snap(
        ready=True,
        models=("llama",),
        tags=("a100",),
        tier="gold",
        cpu=0.5,
        gpus=(GpuSample(0, 0.5, 1, 2, 40, 100),),
        engine=EngineSample(running=1, waiting=2, kv_cache=0.25, tps=10.0),
        rss=1024,
    )


def pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


# The signature's length, as the signer writes it (HMAC-SHA256, possibly truncated).
SIG_LEN = len(msgpack.unpackb(encode(snap(), KEY))["sig"])


# --- verification ------------------------------------------------------------------------------


def test_verifies_with_the_right_key() -> None:
    decoded = decode(encode(full(), KEY), KEYS)
    assert decoded == dataclasses.replace(full(), kid="k1")
    assert decoded.sig is not None
    assert len(decoded.sig) == SIG_LEN


def test_the_signature_is_the_last_map_entry() -> None:
    data = encode(snap(), KEY)
    prefix = pack("sig") + b"\xc4" + bytes([SIG_LEN])  # the key, then a bin 8 header
    assert data[-SIG_LEN - len(prefix) : -SIG_LEN] == prefix
    raw = msgpack.unpackb(data, raw=False)
    assert list(raw)[-1] == "sig"
    assert raw["kid"] == "k1"


def test_the_signature_is_hmac_sha256_of_the_bytes_before_its_entry() -> None:
    data = encode(full(), KEY)
    body = data[: -SIG_LEN - len(pack("sig")) - 2]
    assert SIG_LEN >= 16  # at least 128 bits
    assert data[-SIG_LEN:] == hmac.digest(SECRET, body, hashlib.sha256)[:SIG_LEN]


def test_signing_is_deterministic() -> None:
    assert encode(full(), KEY) == encode(full(), KEY)


def test_verifies_with_one_of_several_keys() -> None:
    old = SigningKey("old", b"an-older-secret-value")
    keys = {KEY.kid: KEY, old.kid: old}
    assert decode(encode(snap(), old), keys).kid == "old"
    assert decode(encode(snap(), KEY), keys).kid == "k1"


def test_fails_with_another_secret() -> None:
    data = encode(snap(), KEY)
    with pytest.raises(SnapshotError, match="does not verify"):
        decode(data, {"k1": SigningKey("k1", b"another-secret-123")})


def test_fails_with_an_unknown_kid() -> None:
    data = encode(snap(), SigningKey("k9", SECRET))
    with pytest.raises(SnapshotError, match="unknown key id 'k9'"):
        decode(data, KEYS)


def test_an_empty_key_set_accepts_nothing() -> None:
    with pytest.raises(SnapshotError):
        decode(encode(snap(), KEY), {})
    with pytest.raises(SnapshotError):
        decode(encode(snap()), {})


def test_unsigned_snapshot_fails_when_keys_are_required() -> None:
    data = encode(snap())
    assert decode(data) == snap()
    with pytest.raises(SnapshotError, match="not signed"):
        decode(data, KEYS)


def test_a_kid_without_a_sig_is_not_signed() -> None:
    raw = msgpack.unpackb(encode(snap()), raw=False)
    raw["kid"] = "k1"
    with pytest.raises(SnapshotError, match="not signed"):
        decode(pack(raw), KEYS)


def test_a_sig_without_a_kid_is_not_signed() -> None:
    raw = msgpack.unpackb(encode(snap(), KEY), raw=False)
    del raw["kid"]
    with pytest.raises(SnapshotError, match="not signed"):
        decode(pack(raw), KEYS)


def test_every_tampered_byte_fails() -> None:
    data = encode(full(), KEY)
    for at in range(len(data)):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[at] ^= flip
            with pytest.raises(SnapshotError):
                decode(bytes(bad), KEYS)


def test_truncated_or_extended_signed_bytes_fail() -> None:
    data = encode(snap(), KEY)
    for cut in range(len(data)):
        with pytest.raises(SnapshotError):
            decode(data[:cut], KEYS)
    with pytest.raises(SnapshotError):
        decode(data + b"\x00", KEYS)


def test_a_zeroed_signature_fails() -> None:
    data = encode(snap(), KEY)
    with pytest.raises(SnapshotError, match="does not verify"):
        decode(data[:-SIG_LEN] + bytes(SIG_LEN), KEYS)


def test_a_signature_that_is_not_last_fails() -> None:
    raw = msgpack.unpackb(encode(snap(), KEY), raw=False)
    moved = {"sig": raw.pop("sig"), **raw}
    with pytest.raises(SnapshotError, match="last map entry"):
        decode(pack(moved), KEYS)


def test_an_entry_after_the_signature_fails() -> None:
    raw = msgpack.unpackb(encode(snap(), KEY), raw=False)
    raw["later"] = 1
    with pytest.raises(SnapshotError):
        decode(pack(raw), KEYS)


def test_a_signature_moved_to_another_snapshot_fails() -> None:
    sig = encode(snap(seq=7), KEY)[-SIG_LEN:]
    other = encode(snap(seq=8), KEY)
    with pytest.raises(SnapshotError, match="does not verify"):
        decode(other[:-SIG_LEN] + sig, KEYS)


def test_a_wrong_length_sig_is_refused() -> None:
    raw = msgpack.unpackb(encode(snap(), KEY), raw=False)
    raw["sig"] = raw["sig"][:-1]
    with pytest.raises(SnapshotError, match="'sig'"):
        decode(pack(raw), KEYS)


def test_unverified_decode_ignores_a_bad_signature() -> None:
    data = encode(snap(), KEY)
    decoded = decode(data[:-SIG_LEN] + bytes(SIG_LEN))
    assert decoded.kid == "k1"
    assert decoded.sig == bytes(SIG_LEN)


def test_signed_encoding_over_the_limit_fails() -> None:
    big = snap(models=("\U0001d11e" * 128,) * 64, tags=("\U0001d11e" * 128,) * 64)
    with pytest.raises(SnapshotError, match="limit"):
        encode(big, KEY)


# --- signing keys ------------------------------------------------------------------------------


def test_signing_key_accepts_16_bytes() -> None:
    assert SigningKey("k", b"x" * 16).secret == b"x" * 16


@pytest.mark.parametrize("secret", [b"", b"x", b"x" * 15])
def test_signing_key_rejects_short_secrets(secret: bytes) -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SigningKey("k", secret)


@pytest.mark.parametrize("kid", ["", "k" * 129])
def test_signing_key_rejects_bad_kids(kid: str) -> None:
    with pytest.raises(ValueError, match=r"1\.\.128"):
        SigningKey(kid, SECRET)


def test_signing_key_accepts_a_128_character_kid() -> None:
    key = SigningKey("k" * 128, SECRET)
    assert decode(encode(snap(), key), {key.kid: key}).kid == "k" * 128


def test_signing_key_repr_hides_the_secret() -> None:
    key = SigningKey("k1", b"super-secret-value-42")
    for text in (repr(key), str(key), f"{key}", repr([key])):
        assert "super-secret" not in text
        assert "k1" in text
        assert "21 bytes" in text


def test_signing_key_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        KEY.secret = b"y" * 16  # type: ignore[misc]


# --- key files ---------------------------------------------------------------------------------


def test_key_file_with_kid(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("k1:0123456789abcdef\n", encoding="utf-8")
    assert load_key_file(path) == SigningKey("k1", SECRET)
    assert load_key_file(str(path)) == SigningKey("k1", SECRET)


def test_key_file_with_a_bare_secret(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("0123456789abcdef", encoding="utf-8")
    assert load_key_file(path) == SigningKey("default", SECRET)


def test_key_file_whitespace_and_later_lines_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("\n\n  k1 : 0123456789abcdef  \r\nsecond:line-is-ignored-entirely\n")
    assert load_key_file(path) == SigningKey("k1", SECRET)


def test_key_file_secret_may_contain_colons(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("k1:abc:def:0123456789\n", encoding="utf-8")
    assert load_key_file(path) == SigningKey("k1", b"abc:def:0123456789")


def test_key_file_secret_is_utf8(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("k1:ééééééééé\n", encoding="utf-8")  # 9 characters, 18 bytes
    assert load_key_file(path).secret == "ééééééééé".encode()


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\n\n",
        b"k1:short",
        b"short",
        b"k1:",
        b":0123456789abcdef",
        b"   :0123456789abcdef",
        b"k" * 129 + b":0123456789abcdef",
        b"\xff\xfe0123456789abcdef",
    ],
    ids=repr,
)
def test_bad_key_file_raises_value_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "key"
    path.write_bytes(content)
    with pytest.raises(ValueError):  # noqa: PT011 - the message differs per cause
        load_key_file(path)


def test_missing_key_file_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read signing key file"):
        load_key_file(tmp_path / "absent")


def test_directory_as_key_file_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read signing key file"):
        load_key_file(tmp_path)


def test_key_file_errors_do_not_leak_the_secret(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("k1:tiny-secret\n", encoding="utf-8")
    with pytest.raises(ValueError, match="at least 16 bytes") as info:
        load_key_file(path)
    assert "tiny-secret" not in str(info.value)


@pytest.mark.parametrize("head", ["my pass", "clé-secrète", "tab\there"])
def test_a_bare_secret_holding_a_colon_is_refused_unechoed(tmp_path: Path, head: str) -> None:
    # Read as KID:SECRET, its head would travel in the clear as every snapshot's key id.
    path = tmp_path / "key"
    path.write_text(f"{head}:phrase long enough to sign with\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 1: not KID:SECRET") as info:
        load_keys(path)
    assert head not in str(info.value)
    assert "phrase" not in str(info.value)


# --- freshness ---------------------------------------------------------------------------------


def test_fresh_snapshot_is_accepted() -> None:
    check = FreshnessCheck(10.0)
    check.check(snap(ts=NOW), now=NOW)
    check.check(snap(ts=NOW - 9.9, seq=8), now=NOW)
    check.check(snap(ts=NOW + 9.9, seq=9), now=NOW)


def test_default_now_is_the_wall_clock() -> None:
    check = FreshnessCheck()
    assert check.window_s == 10.0
    check.check(snap(ts=time.time()))
    with pytest.raises(SnapshotError, match="old"):
        check.check(snap(ts=time.time() - 60, seq=8))


def test_old_snapshot_is_rejected() -> None:
    check = FreshnessCheck(10.0)
    with pytest.raises(SnapshotError, match=r"'node-a' is 10\.1s old"):
        check.check(snap(ts=NOW - 10.1), now=NOW)


def test_future_snapshot_is_rejected() -> None:
    check = FreshnessCheck(10.0)
    with pytest.raises(SnapshotError, match=r"'node-a' is 10\.1s in the future"):
        check.check(snap(ts=NOW + 10.1), now=NOW)
    with pytest.raises(SnapshotError, match="in the future"):
        check.check(snap(ts=1e300), now=NOW)


def test_the_window_is_configurable() -> None:
    check = FreshnessCheck(0.5)
    check.check(snap(ts=NOW - 0.4), now=NOW)
    with pytest.raises(SnapshotError):
        check.check(snap(ts=NOW - 0.6, seq=8), now=NOW)


@pytest.mark.parametrize("seq", [7, 6, 0])
def test_seq_not_newer_in_the_same_boot_is_rejected(seq: int) -> None:
    check = FreshnessCheck()
    check.check(snap(seq=7), now=NOW)
    with pytest.raises(SnapshotError, match=f"seq {seq}, not newer than 7 of boot 'boot-1'"):
        check.check(snap(seq=seq), now=NOW)


def test_the_snapshot_last_accepted_may_pass_again_when_asked_and_no_older_one() -> None:
    # A node replaced at a reload (same sidecar) polls what its predecessor took: refused as a
    # replay, and logged as one.
    check = FreshnessCheck(5.0)
    check.check(snap(seq=7), now=NOW)
    check.check(snap(seq=7), now=NOW, again=True)
    with pytest.raises(SnapshotError, match="seq 6, not newer"):
        check.check(snap(seq=6), now=NOW, again=True)
    with pytest.raises(SnapshotError, match="old"):
        check.check(snap(seq=7, ts=NOW - 6.0), now=NOW, again=True)  # the window still holds
    # A node that left and came back keeps its record through such a pass.
    check.forget("node-a", now=NOW)
    check.check(snap(seq=7), now=NOW, again=True)
    with pytest.raises(SnapshotError, match="seq 6, not newer"):
        check.check(snap(seq=6), now=NOW)
    # And through a refusal: the record stays for the next one too.
    check.forget("node-a", now=NOW)
    for _ in range(2):
        with pytest.raises(SnapshotError, match="seq 6, not newer"):
            check.check(snap(seq=6), now=NOW, again=True)


def test_newer_seq_is_accepted_and_remembered() -> None:
    check = FreshnessCheck()
    for seq in (7, 8, 100):
        check.check(snap(seq=seq), now=NOW)
    with pytest.raises(SnapshotError):
        check.check(snap(seq=99), now=NOW)


def test_new_boot_with_a_lower_seq_is_accepted() -> None:
    check = FreshnessCheck()
    check.check(snap(boot="boot-1", seq=1000), now=NOW)
    check.check(snap(boot="boot-2", seq=0, ts=NOW + 1), now=NOW + 1)
    check.check(snap(boot="boot-2", seq=1, ts=NOW + 2), now=NOW + 2)
    with pytest.raises(SnapshotError):
        check.check(snap(boot="boot-2", seq=1, ts=NOW + 2), now=NOW + 2)


def test_old_and_new_boots_cannot_be_replayed_in_turn() -> None:
    # After a restart, the old boot's snapshots were still inside the window: replayed in
    # turn with the new boot's, each was taken, and the node flipped between ready and its
    # real state (draining here).
    check = FreshnessCheck(5.0)
    old = snap(boot="boot-a", seq=900, ts=NOW - 3, draining=False)
    new = snap(boot="boot-b", seq=1, ts=NOW - 1, draining=True)
    check.check(old, now=NOW)
    check.check(new, now=NOW)
    with pytest.raises(SnapshotError, match="not newer than the last one accepted"):
        check.check(old, now=NOW)


def test_nodes_are_independent() -> None:
    check = FreshnessCheck()
    check.check(snap(node="a", seq=50), now=NOW)
    check.check(snap(node="b", seq=1), now=NOW)
    check.check(snap(node="b", seq=2), now=NOW)
    with pytest.raises(SnapshotError, match="'a'"):
        check.check(snap(node="a", seq=2), now=NOW)
    check.check(snap(node="a", seq=51), now=NOW)


def test_a_rejected_snapshot_is_not_remembered() -> None:
    check = FreshnessCheck()
    check.check(snap(seq=5), now=NOW)
    with pytest.raises(SnapshotError):
        check.check(snap(seq=100, ts=NOW - 60), now=NOW)  # stale: must not raise the bar
    check.check(snap(seq=6), now=NOW)


def test_forget_resets_a_node_once_its_last_snapshot_is_past_the_window() -> None:
    # A node that left and came back at once (a DNS answer that left it out) took a replay of
    # its last snapshot again: it is remembered until that could no longer pass.
    check = FreshnessCheck(10.0)
    check.check(snap(seq=5), now=NOW)
    check.forget("node-a", now=NOW + 1)
    check.forget("never-seen", now=NOW + 1)
    with pytest.raises(SnapshotError, match="not newer than 5"):
        check.check(snap(seq=5), now=NOW + 2)
    check.check(snap(seq=6, ts=NOW + 2), now=NOW + 2)
    check.forget("node-a", now=NOW + 30)  # past the window: nothing of it is kept
    assert not check._gone and not check._last
    check.check(snap(seq=5, ts=NOW + 30), now=NOW + 30)


@pytest.mark.parametrize("window", [0.0, 0, -1.0, math.nan, math.inf, -math.inf])
def test_bad_window_raises_value_error(window: float) -> None:
    with pytest.raises(ValueError, match="freshness window"):
        FreshnessCheck(window)


def test_freshness_repr() -> None:
    assert repr(FreshnessCheck(2.5)) == "FreshnessCheck(window_s=2.5)"


def test_a_key_file_holds_every_key_a_gateway_accepts(tmp_path: Path) -> None:
    # One key only: rotating it refused every sidecar on the other key until all had moved.
    path = tmp_path / "keys"
    path.write_text("new:a-long-enough-new-secret\n\nold:a-long-enough-old-secret\n")
    assert [k.kid for k in load_keys(path)] == ["new", "old"]
    assert load_key_file(path).kid == "new"  # what a sidecar signs with: the first
    path.write_text("a-bare-secret-of-some-length\n")
    assert [k.kid for k in load_keys(path)] == ["default"]
    for text, why in (
        ("k:a-long-enough-secret-1\nk:a-long-enough-secret-2\n", "twice"),
        ("k:a-long-enough-secret-1\na-bare-secret-of-some-length\n", "one KID:SECRET a line"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=why):
            load_keys(path)
