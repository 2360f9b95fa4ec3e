from __future__ import annotations

from typing import Any

import pytest
from promptlb.shared import ConfigError, Snapshot, decode, encode
from promptlb.sidecar import SidecarConfig


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:abc", "http://127.0.0.1:99999", "http://[::1", "http://[::1:80/"]
)
def test_a_url_that_does_not_parse_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError) as error:
        SidecarConfig(model_url=url, node_name="n")
    assert error.value.key == "model_url"


def test_an_ipv6_url_and_its_port_are_accepted() -> None:
    assert SidecarConfig(model_url="http://[::1]:8000/", node_name="n").model_port == 8000


@pytest.mark.parametrize(
    "fields",
    [
        {"models": tuple(f"m{i}" for i in range(65))},
        {"tags": tuple(f"t{i}" for i in range(65))},
        {"models": ("m" * 257,)},
        {"tags": ("",)},
    ],
    ids=["65 models", "65 tags", "a 257-character model", "an empty tag"],
)
def test_models_and_tags_beyond_the_snapshot_limits_are_config_errors(
    fields: dict[str, Any],
) -> None:
    with pytest.raises(ConfigError) as error:
        SidecarConfig(node_name="n", **fields)
    assert error.value.key == next(iter(fields))


def test_models_and_tags_at_the_limits_fit_in_a_snapshot() -> None:
    # A vLLM model id is often a path: 256 characters each, 64 of each.
    models = tuple(f"/models/{i:02}/".ljust(256, "x") for i in range(64))
    tags = tuple(f"t{i}" for i in range(64))
    config = SidecarConfig(node_name="n", models=models, tags=tags)
    snap = Snapshot(node="n", boot="b", seq=1, ts=1.0, models=config.models, tags=config.tags)
    assert decode(encode(snap)).models == models


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"tags": ("gpu\udcff",)}, "tags"),  # argv's undecodable bytes, as Python reads them
        ({"models": ("m\ud800",)}, "models"),
        ({"node_name": "n\udcff"}, "node_name"),
        ({"tier": "t\udcff"}, "tier"),
        # Within each count and length, but 64 KiB of UTF-8 together: no room for the load.
        (
            {
                "models": tuple(f"{i:02}" + "é" * 250 for i in range(64)),
                "tags": tuple(f"{i:02}" + "é" * 250 for i in range(64)),
            },
            "models",
        ),
        # The tags alone: named the models, which were not given.
        ({"tags": tuple(f"{i:02}" + "\U0001f600" * 254 for i in range(64))}, "tags"),
    ],
    ids=["tag", "model", "node name", "tier", "64 KiB of names", "64 KiB of tags"],
)
def test_names_no_snapshot_can_carry_are_config_errors(fields: dict[str, Any], key: str) -> None:
    # Each passed the checks and made every /snapshot a 500.
    with pytest.raises(ConfigError) as error:
        SidecarConfig(**{"node_name": "n", **fields})
    assert error.value.key == key


def test_a_short_token_names_the_token() -> None:
    with pytest.raises(ConfigError) as error:
        SidecarConfig(node_name="n", token="short")
    assert error.value.key == "token" and "short" not in str(error.value)


def test_a_memory_limit_beyond_what_a_snapshot_can_carry_is_a_config_error() -> None:
    # 1e10 MiB: mem_free past 2**53 made every /snapshot fail to encode.
    with pytest.raises(ConfigError) as error:
        SidecarConfig(node_name="n", memory_limit=10**10 * 2**20)
    assert error.value.key == "memory_limit"
    largest = SidecarConfig(node_name="n", memory_limit=2**53)
    snap = Snapshot(node="n", boot="b", seq=1, ts=1.0, mem_free=largest.memory_limit)
    assert decode(encode(snap)).mem_free == 2**53


@pytest.mark.parametrize("devices", [("",), ("0\n1",), tuple(str(i) for i in range(65))])
def test_bad_gpu_device_lists_are_config_errors(devices: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as error:
        SidecarConfig(node_name="n", gpu_devices=devices)
    assert error.value.key == "gpu_devices"


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000?x=1",  # the routes went after it: ...?x=1/health
        "http://127.0.0.1:8000?",
        "http://127.0.0.1:8000/?",
        "http://127.0.0.1:8000/#frag",
        "http://127.0.0.1:8000/v1",  # the OpenAI base URL: /v1/v1/models
        "http://127.0.0.1:8000/v1/",
    ],
)
def test_a_model_url_the_routes_cannot_follow_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError) as error:
        SidecarConfig(model_url=url, node_name="n")
    assert error.value.key == "model_url"


def test_a_model_server_under_a_path_prefix_is_accepted() -> None:
    config = SidecarConfig(model_url="http://127.0.0.1:8000/llama/", node_name="n")
    assert config.model_url == "http://127.0.0.1:8000/llama"


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"warmup_prompts": "Hello"}, "warmup_prompt"),  # five one-letter prompts
        ({"gpu_devices": "GPU-abc"}, "gpu_devices"),  # matched letter by letter
        ({"models": "llama-3"}, "models"),
        ({"tags": None}, "tags"),
        ({"node_name": 5}, "node_name"),
        ({"tier": None}, "tier"),
        ({"token": 12345678901234567890}, "token"),
        ({"model_api_key": b"key"}, "model_api_key"),
    ],
)
def test_values_of_the_wrong_type_are_config_errors_naming_the_key(
    fields: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError) as error:
        SidecarConfig(**{"node_name": "n", **fields})
    assert error.value.key == key
    assert "12345678901234567890" not in str(error.value)  # a secret is never shown


def test_lists_where_tuples_are_expected_are_taken_as_tuples() -> None:
    config = SidecarConfig(node_name="n", models=["a", "b"], warmup_prompts=["Hi"])  # type: ignore[arg-type]
    assert config.models == ("a", "b") and config.warmup_prompts == ("Hi",)
