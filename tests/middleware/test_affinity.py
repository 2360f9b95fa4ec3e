"""Session and prefix affinity: consistent hashing with bounded loads over any strategy, its
config, and the keys the proxy derives from a request."""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import pytest
from aiohttp import web
from promptlb.middleware import PromptLBMiddleware
from promptlb.middleware._affinity import Affinity, KeyMaker, prompt_head
from promptlb.middleware._balancer import Balancer
from promptlb.middleware._config import AffinityConfig, load_config
from promptlb.middleware._nodes import NodeTable
from promptlb.middleware._refusals import NoNodeAvailable
from promptlb.middleware._request import RequestReader
from promptlb.middleware._shedding import Admission
from promptlb.middleware._strategies import make_strategy
from promptlb.middleware._view import NodeView, RouteRequest
from promptlb.shared import ConfigError

from tests.conftest import Serve
from tests.middleware.conftest import MakeNode

MakePool = Callable[[int], list[NodeView]]


@pytest.fixture
def nodes(node: MakeNode) -> MakePool:
    """``nodes(8)``: views node-0 ... node-7, without snapshots."""

    def make(count: int) -> list[NodeView]:
        return [node(f"node-{i}") for i in range(count)]

    return make


def keyed(key: str | None) -> RouteRequest:
    return RouteRequest(model="m", session_key=key)


class Recording:
    """An inner strategy that notes what it was asked and picks the first candidate."""

    name = "recording"
    scoring = None
    prefix_index = None

    def __init__(self) -> None:
        self.picks: list[RouteRequest] = []
        self.observed: list[tuple[str, float, float | None, int]] = []

    def pick(
        self, request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random
    ) -> NodeView:
        self.picks.append(request)
        return candidates[0]

    def observe(
        self,
        request: RouteRequest,
        node: NodeView,
        latency_s: float,
        ttft_s: float | None,
        queue_at_pick: int,
    ) -> None:
        self.observed.append((node.name, latency_s, ttft_s, queue_at_pick))

    def refused(self, request: RouteRequest, node: NodeView) -> None:
        return None

    def forget_node(self, name: str) -> None:
        return None


def test_a_key_stays_on_its_node_when_loads_are_balanced(nodes: MakePool) -> None:
    rng = random.Random(1)
    pool = nodes(8)
    for node in pool:
        node.in_flight = 4  # busy, and evenly so
    affinity = Affinity(make_strategy("p2c"))
    home: dict[str, str] = {}
    same = total = 0
    for _ in range(5):
        for s in range(200):
            key = f"s:session-{s}"
            name = affinity.pick(keyed(key), pool, rng).name
            if key in home:
                total += 1
                same += name == home[key]
            else:
                home[key] = name
    assert same / total >= 0.95
    # and the ring spreads the sessions: no node has more than twice its share of them
    per_node = Counter(home.values())
    assert len(per_node) == 8
    assert max(per_node.values()) <= 2 * 200 / 8


@pytest.mark.parametrize(("epsilon", "at_least"), [(0.25, 0.75), (1.0, 0.97)])
def test_sessions_mostly_keep_their_node_while_requests_come_and_go(
    epsilon: float, at_least: float, nodes: MakePool
) -> None:
    """200 sessions, requests arriving at random and each holding its node for the next 48
    arrivals (6 in flight per node on average). Loads fluctuate, so the bound sends some
    requests past their key's node: the tighter the bound, the more (the price of epsilon)."""
    rng = random.Random(2)
    pool, idle = nodes(8), nodes(8)
    affinity = Affinity(make_strategy("p2c"), epsilon=epsilon)
    in_flight: deque[NodeView] = deque()
    home = 0
    for _ in range(4000):
        key = keyed(f"s:session-{rng.randrange(200)}")
        node = affinity.pick(key, pool, rng)
        home += node.name == affinity.pick(key, idle, rng).name  # the key's own node
        node.in_flight += 1
        in_flight.append(node)
        if len(in_flight) > 48:
            in_flight.popleft().in_flight -= 1
    print(f"epsilon {epsilon}: {home / 4000:.3f} of requests on their key's node")
    assert home / 4000 >= at_least


@pytest.mark.parametrize("epsilon", [0.1, 0.25, 1.0])
def test_a_hot_key_never_pushes_a_node_over_the_bound(epsilon: float, nodes: MakePool) -> None:
    rng = random.Random(3)
    pool = nodes(8)
    affinity = Affinity(make_strategy("p2c"), epsilon=epsilon)
    for m in range(1, 400):
        key = "s:hot" if m % 10 else f"s:cold-{m}"
        node = affinity.pick(keyed(key), pool, rng)
        node.in_flight += 1
        bound = math.ceil((1 + epsilon) * m / len(pool) - 1e-9)
        assert max(n.in_flight for n in pool) <= bound, m
    # the hot key spilled over several nodes rather than piling onto one
    assert sum(1 for n in pool if n.in_flight > 0) == len(pool)


def test_weights_scale_a_nodes_bound(nodes: MakePool) -> None:
    rng = random.Random(4)
    pool = nodes(4)
    pool[0].weight = 3.0
    affinity = Affinity(make_strategy("p2c"), epsilon=0.25)
    for _ in range(600):
        affinity.pick(keyed("s:hot"), pool, rng).in_flight += 1
    # weight 3 of 6: about half, and never over (1 + eps) times its share
    assert pool[0].in_flight <= math.ceil(1.25 * 600 * 3 / 6)
    assert pool[0].in_flight > 600 * 3 / 6 * 0.8


def test_a_node_leaving_moves_only_its_own_keys(nodes: MakePool) -> None:
    rng = random.Random(5)
    pool = nodes(8)
    affinity = Affinity(make_strategy("p2c"))
    keys = [f"s:user-{i}" for i in range(2000)]
    before = {k: affinity.pick(keyed(k), pool, rng).name for k in keys}
    gone = "node-3"
    rest = [n for n in pool if n.name != gone]
    after = {k: affinity.pick(keyed(k), rest, rng).name for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == gone for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] == gone)
    assert len(moved) / len(keys) < 2 / len(pool)  # about 1/n, with the ring's unevenness
    # and when it comes back, its keys come back to it
    again = {k: affinity.pick(keyed(k), pool, rng).name for k in keys}
    assert again == before


def test_replicas_agree_on_a_keys_node(nodes: MakePool) -> None:
    pool_a, pool_b = nodes(6), list(reversed(nodes(6)))  # same names, another order
    a, b = Affinity(make_strategy("p2c")), Affinity(make_strategy("round_robin"))
    for i in range(300):
        key = f"p:{i:016x}"
        assert (
            a.pick(keyed(key), pool_a, random.Random(i)).name
            == b.pick(keyed(key), pool_b, random.Random(-i)).name
        )


def test_requests_without_a_key_go_to_the_inner_strategy(nodes: MakePool) -> None:
    inner = Recording()
    affinity = Affinity(inner)
    pool = nodes(3)
    rng = random.Random(6)
    assert affinity.pick(keyed(None), pool, rng) is pool[0]
    affinity.pick(keyed("s:x"), pool, rng)
    assert [r.session_key for r in inner.picks] == [None]
    assert affinity.name == "recording+affinity"
    with pytest.raises(NoNodeAvailable):
        affinity.pick(keyed("s:x"), [], rng)
    assert affinity.pick(keyed("s:x"), pool[:1], rng) is pool[0]


def test_observe_reaches_the_inner_strategy_when_it_has_the_hook(nodes: MakePool) -> None:
    inner = Recording()
    pool = nodes(2)
    Affinity(inner).observe(keyed("s:x"), pool[1], 0.5, 0.1, 3)
    assert inner.observed == [("node-1", 0.5, 0.1, 3)]
    Affinity(make_strategy("round_robin")).observe(keyed(None), pool[0], 0.5, None, 0)  # no hook


def test_rings_are_built_once_per_candidate_list(nodes: MakePool) -> None:
    affinity = Affinity(make_strategy("p2c"), vnodes=16)
    pool = nodes(4)
    rng = random.Random(7)
    affinity.pick(keyed("s:a"), pool, rng)
    ring = affinity._rings[id(pool)][1]
    affinity.pick(keyed("s:b"), pool, rng)
    assert affinity._rings[id(pool)][1] is ring
    assert len(ring.points) == 4 * 16


def test_model_aware_routes_hold_for_keyed_requests(node: MakeNode) -> None:
    # The ring ran over every candidate: a class routed to one node went to all three.
    routed = make_strategy("model_aware", routes={"code": ["gpu-big"]})
    affinity = Affinity(routed)
    pool = [node("big", tags={"gpu-big"}), node("small1"), node("small2")]
    rng = random.Random(3)
    got = Counter(
        affinity.pick(
            RouteRequest(model="m", session_key=f"s:{i}", prompt_class="code"), pool, rng
        ).name
        for i in range(300)
    )
    assert got == {"big": 300}
    others = Counter(affinity.pick(keyed(f"s:{i}"), pool, rng).name for i in range(300))
    assert len(others) == 3  # an unrouted class keeps the whole ring


def test_a_list_filtered_per_request_finds_the_ring_of_the_same_nodes(nodes: MakePool) -> None:
    # Shedding's admission filter and a retry's list are new objects each request: each
    # rebuilt its ring (64 nodes x 64 points sorted, 2.5 ms a pick). The same nodes in the
    # same order reuse one, and it places each key as the first list's ring does.
    affinity = Affinity(make_strategy("p2c"), vnodes=16)
    pool = nodes(4)
    rng = random.Random(7)
    placed = {k: affinity.pick(keyed(k), pool, rng).name for k in ("s:a", "s:b", "s:c")}
    built = len(affinity._by_names)
    for _ in range(20):
        filtered = [node for node in pool if node.name != "node-3"]
        for k in ("s:a", "s:b", "s:c"):
            chosen = affinity.pick(keyed(k), filtered, rng).name
            assert chosen == placed[k] or placed[k] == "node-3"
        again = list(pool)
        assert {k: affinity.pick(keyed(k), again, rng).name for k in placed} == placed
    assert len(affinity._by_names) == built + 1  # the three-node list's, once


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"key": "sticky"}, "affinity.key"),
        ({"epsilon": 0}, "affinity.epsilon"),
        ({"epsilon": -0.5}, "affinity.epsilon"),
        ({"epsilon": float("inf")}, "affinity.epsilon"),
        ({"vnodes": 0}, "affinity.vnodes"),
        ({"vnodes": 10_000}, "affinity.vnodes"),
        ({"vnodes": 1.5}, "affinity.vnodes"),
        ({"prefix_chars": 0}, "affinity.prefix_chars"),
        ({"header": ""}, "affinity.header"),
        ({"header": "x session"}, "affinity.header"),
        ({"sticky": True}, "affinity.sticky"),
    ],
)
def test_bad_affinity_config_names_the_key(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"nodes": [{"name": "a", "url": "http://a:1"}], "affinity": raw})
    assert info.value.key == key


def test_affinity_is_off_by_default_and_wraps_the_strategy_when_set() -> None:
    nodes_cfg = [{"name": "a", "url": "http://a:1"}]
    plain = load_config({"nodes": nodes_cfg, "strategy": "least_conn"})
    assert plain.affinity is None
    assert Balancer(plain).strategy.name == "least_conn"
    config = load_config(
        {"nodes": nodes_cfg, "strategy": "least_conn", "affinity": {"header": "X-Session-Id"}}
    )
    assert config.affinity == AffinityConfig(header="X-Session-Id")
    strategy = Balancer(config).strategy
    assert isinstance(strategy, Affinity)
    assert strategy.name == "least_conn+affinity"
    assert strategy.inner.name == "least_conn"
    with pytest.raises(ConfigError):
        AffinityConfig(epsilon=True)


def chat(system: str, *turns: str, user: str | None = None) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user", "content": t} for t in turns]
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if user is not None:
        body["user"] = user
    return body


LONG = "You are a careful assistant for the billing team. " * 20  # ~1,000 characters


def test_keys_come_from_the_header_then_user_then_the_prefix() -> None:
    both = KeyMaker(AffinityConfig(header="X-Session-Id", prefix_chars=512))
    headers = [(b"content-type", b"application/json"), (b"x-session-id", b" conv-7 ")]
    assert both.header_value(headers) == "conv-7"
    assert both.header_value([(b"x-session-id", b"  ")]) is None
    assert both(chat(LONG, "hi", user="alice"), "conv-7") == "s:conv-7"
    assert both(chat(LONG, "hi", user="alice")) == "s:alice"
    by_prefix = both(chat(LONG, "hi"))
    assert by_prefix is not None and by_prefix.startswith("p:")
    # a conversation that grows keeps its prefix key; another system prompt gets another
    assert both(chat(LONG, "hi", "and then?", "more")) == by_prefix
    assert both(chat("Another system prompt. " * 40, "hi")) != by_prefix
    assert both(chat("short", "hi")) is None  # under prefix_chars: no key
    assert both({"model": "m", "prompt": LONG}) is not None
    assert both({"model": "m", "prompt": [LONG, "x"]}) == both({"model": "m", "prompt": LONG})
    # The endpoint's field, as the prefix blocks read it: a completion body that also carries
    # messages was keyed by its messages, which its node never sees.
    stray = {"model": "m", "prompt": LONG, **chat("Another system prompt. " * 40, "hi")}
    config = load_config(
        {"nodes": [{"name": "a", "url": "http://127.0.0.1:9"}], "affinity": {"prefix_chars": 512}}
    )
    reader = RequestReader(config, Admission(config.shedding, NodeTable(config)))

    def key(path: str) -> str | None:
        return reader.build(path, stray).route.session_key

    assert key("/v1/completions") == both({"model": "m", "prompt": LONG})
    assert key("/v1/chat/completions") == both(chat("Another system prompt. " * 40, "hi"))


def test_the_key_setting_limits_the_sources() -> None:
    session = KeyMaker(AffinityConfig(key="session", header="x-session-id"))
    assert session(chat(LONG, "hi")) is None
    assert session(chat(LONG, "hi", user="bob")) == "s:bob"
    prefix = KeyMaker(AffinityConfig(key="prefix", header="x-session-id"))
    assert prefix.header_value([(b"x-session-id", b"a")]) is None
    assert prefix(chat(LONG, "hi", user="bob"), None) == prefix(chat(LONG, "hi"))
    no_header = KeyMaker(AffinityConfig())
    assert no_header.header_value([(b"x-session-id", b"a")]) is None


def test_prompt_head_reads_parts_and_stops_early() -> None:
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a" * 300}, {"type": "image"}]},
            {"role": "assistant", "content": None},
            "junk",
            {"role": "user", "content": "b" * 300},
        ]
    }
    head = prompt_head(parts, 512)
    assert head is not None and len(head) == 512
    assert prompt_head(parts, 5000) is None
    assert prompt_head({}, 1) is None


def test_the_reader_puts_the_key_on_the_route_request_only_with_affinity() -> None:
    from promptlb.middleware._request import RequestReader

    def reader(config: dict[str, Any]) -> RequestReader:
        cfg = load_config(config)
        return RequestReader(cfg, Balancer(cfg).admission)

    nodes_cfg = [{"name": "a", "url": "http://a:1"}]
    body = {"model": "m", **chat(LONG, "x", user="u")}
    off = reader({"nodes": nodes_cfg})
    assert off.keys is None
    assert off.build("/v1/chat/completions", body).route.session_key is None
    on = reader({"nodes": nodes_cfg, "affinity": {}})
    assert on.keys is not None
    assert on.build("/v1/chat/completions", body).route.session_key == "s:u"


@pytest.fixture
async def upstream(serve: Serve) -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)  # /health too
    async with serve(app) as url:
        yield url


async def noop(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the app is not reached for balanced routes")


@pytest.mark.parametrize(
    ("affinity", "headers", "body", "expected"),
    [
        (None, {"x-session-id": "h"}, chat(LONG, "x", user="u"), None),
        ({"header": "x-session-id"}, {"X-Session-Id": "h"}, chat(LONG, "x", user="u"), "s:h"),
        ({"header": "x-session-id"}, {}, chat(LONG, "x", user="u"), "s:u"),
        ({"key": "prefix"}, {}, chat(LONG, "x", user="u"), KeyMaker(AffinityConfig())(chat(LONG))),
        ({}, {}, chat("short", "x"), None),
    ],
)
async def test_the_proxy_routes_with_the_key_it_derives(
    upstream: str,
    affinity: dict[str, Any] | None,
    headers: dict[str, str],
    body: dict[str, Any],
    expected: str | None,
) -> None:
    config: dict[str, Any] = {"nodes": [{"name": "a", "url": upstream, "models": ["m"]}]}
    if affinity is not None:
        config["affinity"] = affinity
    app = PromptLBMiddleware(noop, config=config)
    seen: list[str | None] = []
    strategy = app.balancer.strategy
    original = strategy.pick

    def pick(request: RouteRequest, candidates: Sequence[NodeView], rng: random.Random) -> NodeView:
        seen.append(request.session_key)
        return original(request, candidates, rng)

    strategy.pick = pick  # type: ignore[method-assign]
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as http:
            response = await http.post("/v1/chat/completions", headers=headers, json=body)
    finally:
        await app.balancer.stop()
    assert response.status_code == 200
    assert seen == [expected]


def test_keyed_requests_placed_on_the_ring_are_recorded_for_the_sharing_replicas(
    nodes: MakePool,
) -> None:
    """Over a sharing `predictive`, the ring's placements skip the inner pick: its index must
    still record them, or the other replicas, told of every try's end by the balancer but of
    no start, count those nodes' load below zero (and the prefix is not known where it is)."""
    inner = make_strategy("predictive")
    index = inner.prefix_index
    assert index is not None
    index.share()
    affinity = Affinity(inner)
    pool = nodes(3)
    rng = random.Random(1)
    blocks = (11, 12, 13)
    placed = []
    for i in range(10):
        request = RouteRequest(model="m", session_key=f"user-{i}", blocks=blocks)
        placed.append(affinity.pick(request, pool, rng).name)
    sent = index.sent()
    assert [name for name, _ in sent] == placed  # a start for every end to come
    assert all(list(b) == list(blocks) for _, b in sent)
    for name in set(placed):
        view = next(v for v in pool if v.name == name)
        assert index.matches(blocks, [view], 1.0) == {name: 3}
