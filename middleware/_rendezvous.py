"""Where a prefix nobody holds yet starts: rendezvous hashing of its first block over the
candidates, so that every replica, with no state shared, picks the same node, and a node
leaving moves only its own prefixes.

Up to `CLUSTERS` candidates every one is scored. Above that, the candidates fall into
`CLUSTERS` fixed groups by a hash of their names; a weighted rendezvous over the groups (a
group's odds are its size, so every node keeps an even share) picks one, and a rendezvous
among its members the node. Scoring each of 1,000 candidates cost a new prefix's pick 0.8 ms;
the two steps score about 80. Replicas with the same candidates still agree, in any order. A
node leaving moves its own prefixes and, there, some more of its group's (the group's odds
shrink with it: 1.7-2x its own at 300 nodes, more in a group of two or three), never another
group's. Crossing `CLUSTERS` candidates changes the rule, and nearly every new prefix's node
with it. Only prefixes no node holds yet come here: a held one goes where it is held.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from ._view import NodeView

__all__ = ["CLUSTERS", "first_choice"]

CLUSTERS = 64

_NAME_BYTES: dict[str, bytes] = {}
_CLUSTER_OF: dict[str, int] = {}
_CLUSTER_KEYS = [i.to_bytes(2, "little") for i in range(CLUSTERS)]
# The groups of the candidate lists seen last, by the list's identity: the node table hands
# out the same list until a node's state changes. The list is held, so no new one reuses its id.
_GROUPS: dict[int, tuple[Sequence[NodeView], dict[int, list[NodeView]]]] = {}
_LISTS_KEPT = 64
_NAMES_KEPT = 4096


def first_choice(first_block: int, candidates: Sequence[NodeView]) -> NodeView:
    """The node rendezvous hashing of ``first_block`` names among ``candidates``. The score is
    a real mixing hash: CRC-32 seeded with the block is linear in it, and split three nodes
    50/25/25."""
    key = first_block.to_bytes(8, "little")
    if len(candidates) > CLUSTERS:
        candidates = _group(key, candidates)
    best, chosen = b"", candidates[0]
    names = _NAME_BYTES
    if len(names) > _NAMES_KEPT:
        names.clear()  # names come and go under discovery: bounded
    blake2b = hashlib.blake2b
    for node in candidates:
        name = node.name
        raw = names.get(name)
        if raw is None:
            # Encoded once: encoding each name on each call was a third of it (64 nodes: 87 us
            # -> 55 us; it runs over every candidate, for each prefix nobody holds).
            raw = names[name] = name.encode()
        score = blake2b(raw, digest_size=8, key=key).digest()
        if score > best:
            best, chosen = score, node
    return chosen


def _group(key: bytes, candidates: Sequence[NodeView]) -> list[NodeView]:
    """The members of the group that weighted rendezvous hashing of ``key`` picks: the group
    whose ``size / -ln(u)`` is largest, ``u`` the key's uniform hash with the group, which
    picks each group in proportion to its size."""
    best, chosen = -1.0, None
    blake2b = hashlib.blake2b
    for cluster, members in _groups(candidates).items():
        digest = blake2b(_CLUSTER_KEYS[cluster], digest_size=8, key=key).digest()
        u = (int.from_bytes(digest, "little") + 0.5) / 2.0**64  # in (0, 1): a log is defined
        score = len(members) / -math.log(u)
        if score > best:
            best, chosen = score, members
    assert chosen is not None  # (candidates are never empty)
    return chosen


def _groups(candidates: Sequence[NodeView]) -> dict[int, list[NodeView]]:
    held = _GROUPS.get(id(candidates))
    if held is not None and held[0] is candidates:
        return held[1]
    of = _CLUSTER_OF
    if len(of) > _NAMES_KEPT:
        of.clear()
    groups: dict[int, list[NodeView]] = {}
    for node in candidates:
        cluster = of.get(node.name)
        if cluster is None:
            digest = hashlib.blake2b(node.name.encode(), digest_size=8).digest()
            cluster = of[node.name] = int.from_bytes(digest, "little") % CLUSTERS
        groups.setdefault(cluster, []).append(node)
    if len(_GROUPS) >= _LISTS_KEPT:
        _GROUPS.clear()
    _GROUPS[id(candidates)] = (candidates, groups)
    return groups
