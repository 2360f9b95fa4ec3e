from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from promptlb.middleware import Config, NodeConfig, load_config
from promptlb.middleware._live import build_live
from promptlb.middleware._view import RouteRequest
from promptlb.shared import ConfigError

NODE = "[[nodes]]\nname = 'a'\nurl = 'http://127.0.0.1:8000'\n"


def load(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "promptlb.toml"
    path.write_text(text)
    return load_config(path)


def test_a_full_config_loads_with_typed_values(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
strategy = "least_conn"
gossip_interval = "250ms"
stale_after = 3
[strategy_options]
queue_scale = 4.0
[health]
interval = "2s"
expected_statuses = [[200, 300], [404, 405]]
[retry]
attempts = 2
per_try_timeout = "1.5s"
[[nodes]]
name = "a"
url = "http://10.0.0.1:8000/"
sidecar = "http://10.0.0.1:9500"
weight = 3
models = ["llama-70b"]
tags = ["code"]
""",
    )
    assert config.strategy == "least_conn"
    assert config.gossip_interval == 0.25
    assert config.stale_after == 3.0
    assert config.health.interval == 2.0
    assert config.health.expected(404) and not config.health.expected(405)
    assert config.retry.per_try_timeout == 1.5
    assert config.strategy_options == {"queue_scale": 4.0}
    (node,) = config.nodes
    assert node.url == "http://10.0.0.1:8000"  # the trailing slash is dropped
    assert (node.weight, node.models, node.tags) == (3.0, ("llama-70b",), ("code",))


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("strategy = 'fastest'\n" + NODE, "strategy", "one of"),
        ("gossip_interval = 'soon'\n" + NODE, "gossip_interval", "duration"),
        ("[health]\nunhealthy_threshold = 0\n" + NODE, "health.unhealthy_threshold", ">= 1"),
        (
            "[health]\nexpected_statuses = [[200, 300], [300, 200]]\n" + NODE,
            "health.expected_statuses[1]",
            "start < end",
        ),
        ("routes = ['/v1/chat/completions', 'v1/x']\n" + NODE, "routes[1]", "starting with /"),
        # An unset variable substituted into the file: every admin route 403, and no error.
        ("admin_token = ''\n" + NODE, "admin_token", "printable ASCII"),
        ("admin_token = 'pässword'\n" + NODE, "admin_token", "printable ASCII"),
        ("[retry]\nattempts = 'three'\n" + NODE, "retry.attempts", "an integer"),
        ("[retry]\nbudget_percent = 120\n" + NODE, "retry.budget_percent", "0..100"),
        ("[[nodes]]\nname = 'a'\nurl = 'ftp://x'\n", "nodes[0].url", "http(s) URL"),
        ("[[nodes]]\nname = 'a'\n", "nodes[0].url", "required"),
        ("[[nodes]]\nname = 'a'\nurl = 'http://x:1'\nweight = -1\n", "nodes[0].weight", "> 0"),
        # Near 1e308 weighted round robin's sums became NaN; a huge epsilon overflowed the
        # load bound into an error on every keyed pick.
        (
            "[[nodes]]\nname = 'a'\nurl = 'http://x:1'\nweight = 1e300\n",
            "nodes[0].weight",
            "at most",
        ),
        ("[affinity]\nepsilon = 1e308\n" + NODE, "affinity.epsilon", "at most 100"),
        (
            "[[nodes]]\nname = 'a'\nurl = 'http://x:1'\ncolour = 'red'\n",
            "nodes[0].colour",
            "one of",
        ),
        ("stratgy = 'p2c'\n" + NODE, "stratgy", "one of"),
        ("", "nodes", "at least one"),
        (NODE + NODE, "nodes[1].name", "no other node has"),
        ("stale_after = '25h'\n" + NODE, "stale_after", "at most a day"),
        (
            "[[nodes]]\nname = 'a'\nurl = 'http://a:1'\napi_key = 'k'\napi_key_env = 'HOME'\n",
            "nodes[0].api_key_env",
            "no api_key beside it",
        ),
        ("max_body_bytes = 10\n" + NODE, "max_body_bytes", ">= 1024"),
        ("[requests]\nmax_tokens = 0\n" + NODE, "requests.max_tokens", ">= 1"),
        ("[requests]\ncontext = { big = -1 }\n" + NODE, "requests.context.big", ">= 1"),
        ("[requests]\ncontext = { big = 'lots' }\n" + NODE, "requests.context.big", "integer"),
        ("[requests]\nmax_json_depth = 1\n" + NODE, "requests.max_json_depth", ">= 2"),
        ("[requests]\nbody_timeout = 0\n" + NODE, "requests.body_timeout", "> 0"),
        ("[outlier]\nassumed_tokens_per_s = 0\n" + NODE, "outlier.assumed_tokens_per_s", "> 0"),
        ("forward_client_address = 'yes'\n" + NODE, "forward_client_address", "true or false"),
        ("[discovery]\nmode = 'dns'\n", "discovery.name", "DNS name"),
        (NODE + "[discovery]\nmode = 'dns'\nname = 'm.local'\n", "nodes", "none with discovery"),
        # Sent in x-promptlb-node: the server refused the header, every answer failed.
        ('[[nodes]]\nname = "gpu\\n1"\nurl = "http://x:1"\n', "nodes[0].name", "printable"),
        (
            '[[nodes]]\nname = "a"\nurl = "http://x:1"\nmodels = ["ok", "m\\n"]\n',
            "nodes[0].models[1]",
            "printable",
        ),
        (
            "[discovery]\nmode = 'dns'\nname = 'm.local'\nmodels = ['']\n",
            "discovery.models[0]",
            "printable",
        ),
        # A header no request carries was silently the built-in classifier.
        ("class_header = 'x prompt class'\n" + NODE, "class_header", "header name"),
        ("class_header = ''\n" + NODE, "class_header", "header name"),
        ("models_route = 'v1/models'\n" + NODE, "models_route", "starting with /"),
        ("models_route = ''\n" + NODE, "models_route", "starting with /"),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_was_expected(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert info.value.key == key
    assert expected in info.value.expected
    assert str(info.value).startswith(f"{key}: got ")


TWO = NODE + "[[nodes]]\nname = 'b'\n"


@pytest.mark.parametrize(
    ("line", "key", "expected"),
    [
        ("url = 'http://[::1'", "nodes[1].url", "http(s) URL"),
        ("url = 'http://h:99999'", "nodes[1].url", "port in 1..65535"),
        ("url = 'http://h:abc'", "nodes[1].url", "port in 1..65535"),
        ("url = 'http://h:0'", "nodes[1].url", "port in 1..65535"),
        # The routes are appended to the URL: /v1 here would make /v1/v1/chat/completions.
        ("url = 'http://h:8000/v1'", "nodes[1].url", "no path like /v1"),
        ("url = 'http://h:8000/?x=1'", "nodes[1].url", "no query"),
        ("url = 'http://h:8000#top'", "nodes[1].url", "no query"),
        ("url = 'http://h :8000'", "nodes[1].url", "http(s) URL"),
        ("url = 'http://u:p@h:8000'", "nodes[1].url", "without user:password@"),
        ("url = 'http://h:1'\nsidecar = 'http://[::1:9500'", "nodes[1].sidecar", "http(s) URL"),
        ("url = 'http://h:1'\nsidecar = 'http://h:95000'", "nodes[1].sidecar", "1..65535"),
        ("url = 'http://h:1'\nsidecar = 'http://h:9500/snapshot'", "nodes[1].sidecar", "no path"),
        # What aiohttp cannot connect to: a UnicodeError out of every poll stopped the start.
        ("url = 'http://h:1'\nsidecar = 'http://sidecar..local:9500'", "nodes[1].sidecar", "1-63"),
        (f"url = 'http://{'a' * 64}.local:8000'", "nodes[1].url", "labels 1-63 long"),
    ],
)
def test_a_url_that_is_not_a_base_url_is_a_config_error_naming_its_key(
    tmp_path: Path, line: str, key: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, f"{TWO}{line}\n")
    assert info.value.key == key
    assert expected in info.value.expected


def test_base_urls_load_without_their_trailing_slash(tmp_path: Path) -> None:
    config = load(tmp_path, f"{TWO}url = 'https://[::1]:8443/'\nsidecar = 'http://h:9500'\n")
    node = config.nodes[1]
    assert (node.url, node.sidecar) == ("https://[::1]:8443", "http://h:9500")


@pytest.mark.parametrize(
    ("gossip", "stale"),
    # The last two: past the interval, but not its jitter and the round's timeout (0.5 s).
    [("1s", "1s"), ("2s", "1s"), ("500ms", "0.5"), ("2s", "2.5s"), ("1s", "1.6s")],
)
def test_stale_after_must_exceed_the_longest_gap_between_two_rounds(
    tmp_path: Path, gossip: str, stale: str
) -> None:
    # Otherwise a snapshot can be stale before the next round brings one: a draining node
    # flaps to ready meanwhile.
    with pytest.raises(ConfigError) as info:
        load(tmp_path, f"gossip_interval = '{gossip}'\nstale_after = '{stale}'\n{NODE}")
    assert info.value.key == "stale_after"
    assert "gossip_interval" in info.value.expected and "gossip_timeout" in info.value.expected


def test_stale_after_longer_than_the_longest_gap_between_two_rounds_loads(tmp_path: Path) -> None:
    loaded = load(tmp_path, f"gossip_interval = '2s'\nstale_after = '2.8s'\n{NODE}")
    assert (loaded.gossip_interval, loaded.stale_after) == (2.0, 2.8)
    tight = load(
        tmp_path, f"gossip_interval = '1s'\ngossip_timeout = '0.2s'\nstale_after = '1.4s'\n{NODE}"
    )
    assert tight.stale_after == 1.4
    default = Config(nodes=(NodeConfig(name="a", url="http://a:1"),))
    assert default.stale_after > default.gossip_interval
    with pytest.raises(ConfigError, match="stale_after"):  # the default stale_after, in code
        Config(nodes=default.nodes, gossip_interval=default.stale_after)


def test_unreadable_or_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="readable TOML"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="valid TOML"):
        load(tmp_path, "strategy = \n")
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('strategy = "p2c" # caf\xe9\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="UTF-8 TOML"):  # was a UnicodeDecodeError
        load_config(latin1)


def test_a_mapping_or_an_object_works_as_well() -> None:
    as_map = load_config({"nodes": [{"name": "a", "url": "http://127.0.0.1:1"}]})
    as_object = Config(nodes=(NodeConfig(name="a", url="http://127.0.0.1:1"),))
    assert as_map == as_object
    assert load_config(as_object) is as_object


def test_api_keys_come_from_the_environment_and_stay_out_of_repr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NODE_A_KEY", "sk-secret")
    node = NodeConfig(name="a", url="http://127.0.0.1:1", api_key_env="NODE_A_KEY")
    assert node.api_key == "sk-secret"
    assert "sk-secret" not in repr(node)
    monkeypatch.delenv("NODE_A_KEY")
    with pytest.raises(ConfigError, match="api_key_env"):
        NodeConfig(name="a", url="http://127.0.0.1:1", api_key_env="NODE_A_KEY")


def test_fallback_cache_and_shedding_tables_load_typed() -> None:
    config = load_config(
        {
            "nodes": [{"name": "a", "url": "http://a:1"}],
            "cache": {"backend": "redis://:pw@cache:6379/0", "ttl": "1m", "families": {"x": "f"}},
            "fallback": [
                {"model": "big", "then": ["small", "cache"], "ttft": "3s", "total": "30s"}
            ],
            "shedding": {"enabled": True, "queue_timeout": "250ms"},
        }
    )
    assert config.cache is not None and config.cache.ttl == 60.0
    assert config.cache.families == {"x": "f"}
    assert "pw" not in repr(config.cache)
    chain = config.fallback[0]
    assert (chain.then, chain.ttft, chain.total, chain.models) == (
        ("small", "cache"),
        3.0,
        30.0,
        ("small",),
    )
    assert config.shedding.queue_timeout == 0.25


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"fallback": [{"model": "big", "then": ["cache"]}]}, "fallback[0].then"),
        ({"fallback": [{"model": "big", "then": ["big"]}]}, "fallback[0].then[0]"),
        # Sent in x-promptlb-model: every fallback answer dropped, charged to its node.
        ({"fallback": [{"model": "big", "then": ["small\n"]}]}, "fallback[0].then[0]"),
        ({"fallback": [{"model": "big\t"}]}, "fallback[0].model"),
        ({"fallback": [{"model": "big", "then": ["m" * 257]}]}, "fallback[0].then[0]"),
        ({"fallback": [{"model": "b", "then": ["s"]}, {"model": "b", "then": []}]}, "fallback[1]"),
        ({"fallback": [{"model": "b", "ttft": "5s", "total": "1s"}]}, "fallback[0].total"),
        ({"fallback": [{"model": "b", "ttft": "1s", "hedge_after": "2s"}]}, "fallback[0].hedge"),
        # Due after the hop's whole time, a hedge never goes: it was taken, and did nothing.
        (
            {"fallback": [{"model": "b", "then": ["s"], "hedge_after": "5s", "total": "1s"}]},
            "fallback[0].hedge_after",
        ),
        (
            {"fallback": [{"model": "b", "hedge_after": "40s"}], "retry": {"total_timeout": "30s"}},
            "fallback[0].hedge_after",
        ),
        ({"cache": {"backend": "memcached://x"}}, "cache.backend"),
        ({"cache": {"ttl": "1h", "stale_ttl": "1m"}}, "cache.stale_ttl"),
        ({"cache": {"families": {"a": 3}}}, "cache.families.a"),
    ],
)
def test_bad_degradation_config_names_the_key(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config({"nodes": [{"name": "a", "url": "http://a:1"}], **extra})


def test_caller_headers_are_header_names() -> None:
    base = {"nodes": [{"name": "a", "url": "http://a:1"}]}
    assert load_config({**base, "caller_headers": ["X-Sub-Key"]}).caller_headers == ("X-Sub-Key",)
    with pytest.raises(ConfigError) as info:
        load_config({**base, "caller_headers": ["ok", "no spaces"]})
    assert info.value.key == "caller_headers[1]"


@pytest.mark.parametrize(
    ("table", "url"),
    [
        ("cache", "redis://h:abc"),
        ("cache", "redis://h:99999/0"),
        ("cache", "redis://[::1"),
        ("cache", "unix:///tmp/r.sock?db=x"),
        ("index_share", "redis://h:abc"),
        ("index_share", "rediss://h:6380/0?socket_timeout=soon"),
        # Parsed, but no connection takes the option: every cache call raised a TypeError.
        ("cache", "redis://r:6379/0?ssl_cert_reqs=none"),
        ("index_share", "redis://r:6379/0?foo=bar"),
        # Options promptlb sets itself, which the URL's would override: RESP3 and decoded
        # replies broke every round of the share, a socket timeout replaced the configured.
        ("index_share", "redis://r:6379/0?protocol=3"),
        ("index_share", "redis://r:6379/0?decode_responses=true"),
        ("index_share", "redis://r:6379/0?decode_responses=false"),  # unparsed: a true string
        ("cache", "redis://r:6379/0?socket_timeout=3"),
        ("cache", "redis://r:6379/0?db=1&socket_connect_timeout=3"),
    ],
)
def test_a_redis_url_redis_py_would_refuse_is_a_config_error(table: str, url: str) -> None:
    # At startup, or halfway through a reload, redis-py would raise a bare ValueError instead.
    key = {"cache": "backend", "index_share": "redis"}[table]
    with pytest.raises(ConfigError) as info:
        load_config({"nodes": [{"name": "a", "url": "http://a:1"}], table: {key: url}})
    assert info.value.key == f"{table}.{key}"
    assert "redis://host:port/db URL" in info.value.expected


def test_a_redis_url_may_name_what_promptlb_would_set_alike() -> None:
    url = "redis://r:6379/0?protocol=2&health_check_interval=10"
    config = load_config({"nodes": [{"name": "a", "url": "http://a:1"}], "cache": {"backend": url}})
    assert config.cache is not None


def test_a_redis_url_error_keeps_the_password_out() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            {"nodes": [{"name": "a", "url": "http://a:1"}], "cache": {"backend": "redis://:pw@h:x"}}
        )
    assert info.value.value == "redis://***@h:x"
    assert "pw" not in str(info.value)


SECRET = "s3cr3t-value"


@pytest.mark.parametrize(
    "data",
    [
        # Mistyped keys: the value may be the secret the key was meant to hold.
        {"admin_tokne": SECRET},
        {"nodes": [{"name": "a", "url": "http://a:1", "apikey": SECRET}]},
        {"shedding": {"priority-token": SECRET}},
        # The right key with a value of the wrong type.
        {"admin_token": [SECRET]},
        {"nodes": [{"name": "a", "url": "http://a:1", "api_key": [SECRET]}]},
        # Passwords in URLs: a query parameter redis-py takes, a node's user:password@.
        {"cache": {"backend": f"redis://h:6379/0?password={SECRET}&socket_timeout=x"}},
        {"index_share": {"redis": f"redis://h:6379/0?Password={SECRET}&db=x"}},
        {"nodes": [{"name": "a", "url": f"http://user:{SECRET}@a:1"}]},
        # A password that holds @: the user part ends at the last one.
        {"nodes": [{"name": "a", "url": f"http://user:{SECRET}@x@a:1"}]},
        {"cache": {"backend": f"redis://:{SECRET}@x@h:6379/0?socket_timeout=x"}},
        {"cache": {"backend": f"redis://h:6379/0?password={SECRET}&ssl_cert_reqs=none"}},
    ],
)
def test_no_error_prints_a_secret(data: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"nodes": [{"name": "a", "url": "http://a:1"}], **data})
    assert SECRET not in str(info.value) and SECRET not in repr(info.value.value)


def test_no_repr_prints_a_redis_password() -> None:
    config = load_config(
        {
            "nodes": [{"name": "a", "url": "http://a:1"}],
            "cache": {"backend": f"redis://r:6379/0?password={SECRET}"},
            "index_share": {"redis": f"redis://:{SECRET}@r:6379/0"},
        }
    )
    assert SECRET not in repr(config)
    assert "redis://r:6379/0?password=***" in repr(config.cache)


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "rediss://:pw@cache:6380/1", "unix:///tmp/r.sock"]
)
def test_good_redis_urls_load(url: str) -> None:
    nodes = [{"name": "a", "url": "http://a:1"}]
    config = load_config({"nodes": nodes, "cache": {"backend": url}, "index_share": {"redis": url}})
    assert config.cache is not None and config.cache.backend == url
    assert config.index_share is not None and config.index_share.redis == url


def test_the_shipped_example_config_loads() -> None:
    """examples/cluster.toml is what examples/app.py and the README point a new user at."""
    example = Path(__file__).resolve().parents[2] / "examples" / "cluster.toml"
    config = load_config(example)
    assert [n.name for n in config.nodes] == ["node-a", "node-b"]
    assert config.strategy == "predictive"
    assert all(n.sidecar for n in config.nodes)


@pytest.mark.parametrize(("table", "key"), [("cache", "backend"), ("index_share", "redis")])
def test_a_redis_url_without_the_redis_extra_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, table: str, key: str
) -> None:
    """Without redis-py the URL was accepted, and the gateway failed as it started or, on a
    reload, raised ModuleNotFoundError out of a half-applied one."""
    monkeypatch.setitem(sys.modules, "redis.asyncio.connection", None)  # import fails
    with pytest.raises(ConfigError) as info:
        load_config({"nodes": [{"name": "a", "url": "http://a:1"}], table: {key: "redis://h/0"}})
    assert info.value.key == f"{table}.{key}"
    assert "promptlb[redis]" in info.value.expected


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"default": 3}, "strategy_options.default"),
        ({"default": "gpu"}, "strategy_options.default"),  # one tag, mistyped as a string
        ({"routes": 3}, "strategy_options.routes"),
        ({"routes": {"code": 5}}, "strategy_options.routes.code"),
        ({"routes": {"code": True}}, "strategy_options.routes.code"),
        # Without a classifier or class header the classes are the built-in ones.
        ({"routes": {"cdoe": ["gpu"]}}, "strategy_options.routes.cdoe"),
    ],
)
def test_model_aware_options_of_the_wrong_shape_are_config_errors(
    options: dict[str, Any], key: str
) -> None:
    # They were a TypeError or AttributeError out of the gateway's start, or out of a reload.
    data = {"nodes": [{"name": "a", "url": "http://a:1"}], "strategy": "model_aware"}
    with pytest.raises(ConfigError) as info:
        build_live(load_config({**data, "strategy_options": options}), None)
    assert info.value.key == key


def test_a_class_of_its_own_is_a_route_under_a_classifier_or_class_header() -> None:
    config = load_config(
        {
            "nodes": [
                {"name": "a", "url": "http://a:1"},
                {"name": "cpu", "url": "http://cpu:1", "tags": ["cpu"]},
            ],
            "strategy": "model_aware",
            "class_header": "x-class",
            "strategy_options": {"routes": {"batch": ["cpu"]}},
        }
    )
    live = build_live(config, None)  # not refused: a class the header may name is a route
    views = [node.view for node in live.balancer.table.nodes.values()]
    batch = RouteRequest(model="m", prompt_class="batch")
    rng = random.Random(1)
    assert {live.balancer.strategy.pick(batch, views, rng).name for _ in range(20)} == {"cpu"}


def test_a_token_file_that_is_not_text_is_a_config_error(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe\x00binary")
    config = load_config(
        {"nodes": [{"name": "a", "url": "http://a:1"}], "admin_token_file": str(token)}
    )
    with pytest.raises(ConfigError, match="UTF-8") as info:
        config.admin_secret()
    assert info.value.key == "admin_token_file"


def test_a_token_file_of_two_lines_is_a_config_error(tmp_path: Path) -> None:
    # Old and new token, mid-rotation: sent as a header, aiohttp refused it on every poll and
    # check, and every node stayed "unknown" for good (every request a 503).
    token = tmp_path / "token"
    token.write_text("old-token\nnew-token\n")
    config = load_config(
        {"nodes": [{"name": "a", "url": "http://a:1"}], "sidecar_token_file": str(token)}
    )
    with pytest.raises(ConfigError, match="one line") as info:
        config.sidecar_token()
    assert info.value.key == "sidecar_token_file"
    token.write_text("the-token\n")  # a file's last newline is no second line
    assert config.sidecar_token() == "the-token"


def test_a_node_api_key_is_stripped_and_one_with_a_line_break_inside_refused_unprinted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Kubernetes Secret made from a file ends in a newline: aiohttp refused the header on
    # every try, which failed outright (neither retried elsewhere nor charged to the node).
    monkeypatch.setenv("NODE_KEY", "sk-secret\n")
    node = NodeConfig(name="a", url="http://a:1", api_key_env="NODE_KEY")
    assert node.api_key == "sk-secret"
    assert dataclasses.replace(node, weight=2.0).api_key == "sk-secret"  # copied as read
    assert NodeConfig(name="a", url="http://a:1", api_key=" sk-x ").api_key == "sk-x"
    monkeypatch.setenv("NODE_KEY", "sk-old\nsk-new")
    with pytest.raises(ConfigError) as info:
        NodeConfig(name="a", url="http://a:1", api_key_env="NODE_KEY")
    assert info.value.key == "api_key_env" and "sk-" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config({"nodes": [{"name": "a", "url": "http://a:1", "api_key": "sk-1\r\nX: y"}]})
    assert info.value.key == "nodes[0].api_key" and "sk-" not in str(info.value)


@pytest.mark.parametrize("name", ["gw..svc.cluster.local", "a" * 64 + ".svc"])
def test_a_discovery_name_the_resolver_refuses_is_a_config_error(name: str) -> None:
    # UnicodeError out of the lookup stopped the start naming no key, or left a reload with
    # no gossip or health loops at all.
    with pytest.raises(ConfigError) as info:
        load_config({"discovery": {"mode": "dns", "name": name}})
    assert info.value.key == "discovery.name" and "1-63" in info.value.expected


def test_no_expected_status_at_all_is_refused() -> None:
    # Every health check failed: every node unhealthy from the start, every request a 503.
    with pytest.raises(ConfigError) as info:
        load_config(
            {"nodes": [{"name": "a", "url": "http://a:1"}], "health": {"expected_statuses": []}}
        )
    assert info.value.key == "health.expected_statuses"


def test_discovered_nodes_without_sidecars_are_said_with_port_0() -> None:
    # TOML has no null, and None was the only way to say it.
    dns = {"mode": "dns", "name": "models.local", "sidecar_port": 0}
    config = load_config({"discovery": dns})
    assert config.discovery.sidecar_port is None


def test_every_config_table_can_be_built_from_the_public_api() -> None:
    import promptlb.middleware as public

    config = Config(
        nodes=(NodeConfig(name="a", url="http://a:1"),),
        cache=public.CacheConfig(),
        fallback=(public.FallbackConfig(model="big", then=("small",)),),
        shedding=public.SheddingConfig(enabled=True),
        affinity=public.AffinityConfig(),
        batching=public.BatchingConfig(),
        index_share=public.IndexShareConfig(redis="redis://127.0.0.1:6379/0"),
    )
    assert config.index_share is not None


def test_the_readme_names_every_config_key() -> None:
    # examples/cluster.toml says the README lists them all; a dozen keys were missing.
    import dataclasses
    import re

    import promptlb.middleware as public

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    # Only where keys are written: the TOML blocks and `code` spans, not the prose, where
    # `name`, `url` or `timeout` would always be found.
    readme = "\n".join(
        re.findall(r"```toml\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    )
    tables = [
        public.Config,
        public.NodeConfig,
        public.DiscoveryConfig,
        public.HealthConfig,
        public.OutlierConfig,
        public.RetryConfig,
        public.RequestsConfig,
        public.CacheConfig,
        public.FallbackConfig,
        public.SheddingConfig,
        public.BatchingConfig,
        public.AffinityConfig,
        public.IndexShareConfig,
    ]
    missing = [
        f"{table.__name__}.{field.name}"
        for table in tables
        for field in dataclasses.fields(table)
        if not re.search(rf"(?<![\w.-]){field.name}\b", readme)
    ]
    assert not missing


def test_a_node_read_from_the_environment_can_be_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    monkeypatch.setenv("NODE_KEY", "from-env")
    node = NodeConfig(name="a", url="http://a:1", api_key_env="NODE_KEY")
    assert dataclasses.replace(node, weight=2.0).api_key == "from-env"


@pytest.mark.parametrize("prefix", ["ops", "/ops/", "/管理", "/ops-é", "/a b", "/a?b"])
def test_an_admin_prefix_that_is_no_ascii_path_is_a_config_error(prefix: str) -> None:
    # The dashboard's redirect writes it into a Location header: a CJK prefix was a 500 there.
    with pytest.raises(ConfigError) as info:
        load_config({"nodes": [{"name": "a", "url": "http://a:1"}], "admin_prefix": prefix})
    assert info.value.key == "admin_prefix"


def test_an_ascii_admin_prefix_loads() -> None:
    config = load_config({"nodes": [{"name": "a", "url": "http://a:1"}], "admin_prefix": "/ops/lb"})
    assert config.admin_prefix == "/ops/lb"


@pytest.mark.parametrize("text", ["", "\n", "pässword\n"])
def test_an_admin_token_file_holding_no_ascii_token_is_refused(tmp_path: Path, text: str) -> None:
    """A Secret mounted before it was filled: every admin route answered 403, no error at
    start (the inline admin_token was refused so, the file not)."""
    secret = tmp_path / "admin"
    secret.write_text(text, encoding="utf-8")
    config = load_config(
        {"nodes": [{"name": "a", "url": "http://a:1"}], "admin_token_file": str(secret)}
    )
    with pytest.raises(ConfigError) as info:
        config.admin_secret()
    assert info.value.key == "admin_token_file"
