"""The container image and the local compose stack: images cannot be pulled or built here, so
the Dockerfile and compose.yaml are read and checked against the package and the manifests."""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from promptlb.middleware import load_config

from tests.ops.conftest import EXAMPLES, ROOT, load_yaml_documents

COMPOSE = EXAMPLES / "compose.yaml"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def _all(word: str) -> list[str]:
    return [rest for w, rest in _instructions() if w == word]


def _k8s_port(deployment: str, container: str, port: str) -> int:
    for doc in load_yaml_documents(EXAMPLES / "k8s" / f"{deployment}.yaml"):
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["name"] == container:
                    return int(next(p for p in c["ports"] if p["name"] == port)["containerPort"])
    raise AssertionError((deployment, container, port))


GATEWAY_PORT = _k8s_port("gateway", "gateway", "http")
SIDECAR_PORT = _k8s_port("model-server", "sidecar", "sidecar")
MODEL_PORT = _k8s_port("model-server", "model", "http")


def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def test_the_base_image_is_a_slim_python_pinned_by_version() -> None:
    [base] = _all("FROM")  # one stage
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim(-\w+)?", base), base
    minimum = _pyproject()["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, base[7:].split("-")[0].split(".")[:2])) >= tuple(
        map(int, minimum.split("."))
    )


def test_it_runs_as_a_user_it_creates_not_root() -> None:
    users = _all("USER")
    assert users, "no USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    created = " ".join(r for r in _all("RUN") if "useradd" in r)
    assert f"--uid {user}" in created or re.search(rf"\b{user}\b", created), created
    # the user is set after every RUN that installs
    words = [w for w, _ in _instructions()]
    assert max(i for i, w in enumerate(words) if w == "RUN") < words.index("USER")


def test_one_image_installs_both_entry_points_from_the_whole_package() -> None:
    project = _pyproject()
    install = " ".join(r for r in _all("RUN") if "pip install" in r)
    extras = re.search(r'"\.\[([\w,]+)\]"', install)
    assert extras is not None, install
    assert {"sidecar", "middleware"} <= set(extras[1].split(","))
    assert set(extras[1].split(",")) <= set(project["project"]["optional-dependencies"])
    scripts = project["project"]["scripts"]
    assert {"promptlb-gateway", "promptlb-sidecar"} <= set(scripts)
    # every package folder of the wheel is copied in, or the install would silently lack it
    copied = {rest.split()[0] for rest in _all("COPY")}
    assert set(project["tool"]["setuptools"]["package-dir"].values()) <= copied
    assert {"pyproject.toml", "README.md"} <= {w for rest in _all("COPY") for w in rest.split()}
    [cmd] = _all("CMD")
    argv = json.loads(cmd)
    assert argv[0] == "promptlb-gateway" and argv[argv.index("--port") + 1] == str(GATEWAY_PORT)
    exposed = {int(p) for rest in _all("EXPOSE") for p in rest.split()}
    assert exposed == {GATEWAY_PORT, SIDECAR_PORT}


def test_the_healthcheck_asks_an_http_endpoint_named_by_the_environment() -> None:
    [check] = _all("HEALTHCHECK")
    assert "--interval=" in check and "--timeout=" in check and "CMD" in check
    command = json.loads(check.split("CMD", 1)[1])
    assert command[0] == "python" and "PROMPTLB_HEALTH_URL" in command[-1]
    compile(command[-1], "healthcheck", "exec")
    env = " ".join(_all("ENV"))
    assert f"PROMPTLB_HEALTH_URL=http://127.0.0.1:{GATEWAY_PORT}/v1/models" in env


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)


# --- compose --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    with COMPOSE.open() as f:
        loaded: dict[str, Any] = yaml.safe_load(f)
    return loaded


def _argv(service: dict[str, Any]) -> dict[str, str]:
    command = service["command"]
    return {a: b for a, b in itertools.pairwise(command) if a.startswith("--")}


def test_the_stack_has_every_piece(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"gateway", "redis", "prometheus", "grafana"} <= set(services)
    models = [n for n, s in services.items() if s.get("command", [""])[0] == "promptlb-emulator"]
    sidecars = [n for n, s in services.items() if s.get("command", [""])[0] == "promptlb-sidecar"]
    assert len(models) >= 2 and len(sidecars) == len(models)
    for name in (*models, *sidecars, "gateway"):
        build = services[name]["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == (
            ROOT / "Dockerfile"
        )
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (COMPOSE.parent / source).exists(), volume
    for secret in compose["secrets"].values():
        assert (COMPOSE.parent / secret["file"]).exists()


def test_sidecars_sit_beside_their_models_on_the_manifests_ports(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        if service.get("command", [""])[0] != "promptlb-sidecar":
            continue
        model = service["network_mode"].removeprefix("service:")
        assert service["pid"] == f"service:{model}"  # it reads the model server's RSS
        args = _argv(service)
        assert int(args["--port"]) == SIDECAR_PORT, name
        assert args["--model-url"] == f"http://127.0.0.1:{MODEL_PORT}"
        assert int(_argv(services[model])["--port"]) == MODEL_PORT
        assert args["--host"] == "0.0.0.0"
        health = service["environment"]["PROMPTLB_HEALTH_URL"]
        assert health == f"http://127.0.0.1:{SIDECAR_PORT}/metrics"
        token = args["--token-file"].removeprefix("/run/secrets/")
        assert token in service["secrets"]


def test_the_gateway_config_loads_and_names_the_stacks_nodes(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    services = compose["services"]
    gateway = services["gateway"]
    args = _argv(gateway)
    assert int(args["--port"]) == GATEWAY_PORT
    assert gateway["ports"] == [f"127.0.0.1:{GATEWAY_PORT}:{GATEWAY_PORT}"]
    source, target = gateway["volumes"][0].split(":")[:2]
    assert target == args["--config"]
    config = load_config(COMPOSE.parent / source)
    models = {n for n, s in services.items() if s.get("command", [""])[0] == "promptlb-emulator"}
    assert {n.name for n in config.nodes} == models
    for node in config.nodes:
        assert node.url == f"http://{node.name}:{MODEL_PORT}"
        assert node.sidecar == f"http://{node.name}:{SIDECAR_PORT}"
    assert config.cache is not None and config.cache.backend.startswith("redis://redis:")
    path = config.admin_token_file
    assert path is not None and path.removeprefix("/run/secrets/") in gateway["secrets"]
    # The sidecar token drains sidecars: a gateway has no use for it (their reads are open).
    assert config.sidecar_token_file is None and gateway["secrets"] == ["promptlb-admin-token"]
    # Published on this machine only: the stack's tokens are in the repository.
    for service in services.values():
        assert all(str(p).startswith("127.0.0.1:") for p in service.get("ports", []))


def test_prometheus_and_grafana_see_the_stack(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prometheus = services["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"])
    config = yaml.safe_load((COMPOSE.parent / "prometheus/prometheus.yml").read_text())
    assert mounts["./prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    assert config["rule_files"] == [mounts["./prometheus/alerts.yml"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gateway = jobs["promptlb-gateway"]
    assert gateway["metrics_path"] == "/_promptlb/metrics"
    assert gateway["static_configs"][0]["targets"] == [f"gateway:{GATEWAY_PORT}"]
    secret = gateway["authorization"]["credentials_file"].removeprefix("/run/secrets/")
    assert secret in prometheus["secrets"] and secret in services["gateway"]["secrets"]
    models = {n for n, s in services.items() if s.get("command", [""])[0] == "promptlb-emulator"}
    targets = set(jobs["promptlb-sidecar"]["static_configs"][0]["targets"])
    assert targets == {f"{m}:{SIDECAR_PORT}" for m in models}
    grafana = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    board = grafana["./grafana/promptlb.json"]
    provider = yaml.safe_load(
        (EXAMPLES / "grafana/provisioning/dashboards/promptlb.yaml").read_text()
    )
    assert str(Path(board).parent) == provider["providers"][0]["options"]["path"]
    datasource = yaml.safe_load(
        (EXAMPLES / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and datasource["type"] == "prometheus"
