"""Where a prefix nobody holds starts: the same node for every replica, moved only by the
node's own leaving, an even share per node, at any number of candidates."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from promptlb.middleware import _rendezvous as rendezvous
from promptlb.middleware._rendezvous import CLUSTERS, first_choice
from promptlb.middleware._view import NodeView

from tests.middleware.conftest import MakeNode

_RNG = random.Random(7)
KEYS = [_RNG.getrandbits(63) for _ in range(6_000)]


def placed(views: list[NodeView], keys: list[int] = KEYS) -> dict[int, str]:
    return {key: first_choice(key, views).name for key in keys}


@pytest.mark.parametrize("count", [3, CLUSTERS, CLUSTERS + 1, 300])
def test_replicas_agree_whatever_the_order_of_their_candidates(node: MakeNode, count: int) -> None:
    views = [node(f"pod-{i}") for i in range(count)]
    shuffled = views[:]
    random.Random(count).shuffle(shuffled)
    keys = KEYS[:500]
    assert placed(views, keys) == placed(shuffled, keys)
    assert placed(views, keys) == placed(list(views), keys)  # (a new list: no cached groups)


@pytest.mark.parametrize("count", [CLUSTERS, 300])
def test_a_node_leaving_moves_its_own_prefixes_and_above_the_groups_few_more(
    node: MakeNode, count: int
) -> None:
    views = [node(f"pod-{i}") for i in range(count)]
    before = placed(views)
    for gone in (views[0], views[count // 2]):
        after = placed([v for v in views if v is not gone])
        moved = {key for key in KEYS if after[key] != before[key]}
        own = {key for key in KEYS if before[key] == gone.name}
        if count <= CLUSTERS:
            assert moved == own
        else:  # its group's odds shrink with it: some more of its group's move too
            of = rendezvous._CLUSTER_OF
            group = {v.name for v in views if of[v.name] == of[gone.name]}
            assert own <= moved and {before[key] for key in moved} <= group


def test_above_the_groups_every_node_keeps_an_even_share(node: MakeNode) -> None:
    # The groups differ in size (300 names over 64 groups: from 1 to about 10), and a group
    # is picked in proportion to its size: a node alone in its group got six times its share
    # were the groups picked alike.
    views = [node(f"pod-{i}") for i in range(300)]
    rng = random.Random(3)
    keys = [rng.getrandbits(63) for _ in range(30_000)]
    shares = Counter(first_choice(key, views).name for key in keys)
    assert len(shares) == 300
    assert max(shares.values()) < 2 * 100 and min(shares.values()) > 100 // 2, shares
