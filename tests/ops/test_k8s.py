"""The Kubernetes examples: valid against the schemas (offline), and consistent with each other,
with the gateway's config loader and with the metrics the sidecar exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from promptlb.middleware import load_config
from promptlb.shared import parse_duration

from tests.ops.conftest import EXAMPLES, ROOT, load_yaml_documents

K8S = EXAMPLES / "k8s"
KUBERNETES = "1.30"
FILES = sorted(K8S.glob("*.yaml"))  # what `kubectl apply -f examples/k8s/` applies
SECRET = K8S / "secret.yaml.example"  # created by hand, with real values: not in that set


def _all() -> list[dict[str, Any]]:
    return [doc for path in (*FILES, SECRET) for doc in load_yaml_documents(path)]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _all() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def _flags(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"] if "=" in arg)


@pytest.mark.parametrize("path", [*FILES, SECRET], ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    docs = load_yaml_documents(path)
    assert docs
    for doc in docs:
        # strict: an unknown or misspelt field is an error, not silently ignored
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_validator_works_offline_and_catches_a_typo() -> None:
    service = _one("Service", "promptlb-model")
    broken = {**service, "spec": {**service["spec"], "clusterIp": "None"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_one_namespace_and_unique_names() -> None:
    docs = _all()
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    # the adapter's rules live with prometheus-adapter, wherever that is installed
    assert namespaces - {"monitoring"} == {_one("Namespace", "promptlb")["metadata"]["name"]}
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("name", ["promptlb-model", "promptlb-gateway"])
def test_selectors_match_the_pods_and_services_reach_named_ports(name: str) -> None:
    deployment = _one("Deployment", name)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    service = _one("Service", name)
    assert service["spec"]["selector"].items() <= labels.items()
    pdb = _one("PodDisruptionBudget", name)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {
        p["name"]: p["containerPort"]
        for c in deployment["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports, port
    # Scraped by prometheus-k8s.yml's own jobs (the gateway's with its admin token): an
    # annotation-driven job beside them would scrape twice under other job names.
    annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
    assert not any(key.startswith("prometheus.io/") for key in annotations)


def test_prometheus_in_kubernetes_finds_each_pod_by_the_labels_and_ports_it_has() -> None:
    config = yaml.safe_load((EXAMPLES / "prometheus" / "prometheus-k8s.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # the names the alerts and the board key on
    alerts = (EXAMPLES / "prometheus" / "alerts.yml").read_text()
    assert set(jobs) == {"promptlb-gateway", "promptlb-sidecar"}
    assert 'job="promptlb-sidecar"' in alerts
    for job_name, deployment, port in (
        ("promptlb-gateway", "promptlb-gateway", "http"),
        ("promptlb-sidecar", "promptlb-model", "sidecar"),
    ):
        pod = _one("Deployment", deployment)["spec"]["template"]
        keep = {
            rule["source_labels"][0]: rule["regex"]
            for rule in jobs[job_name]["relabel_configs"]
            if rule.get("action") == "keep"
        }
        label = pod["metadata"]["labels"]["app.kubernetes.io/name"]
        assert keep["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == label
        names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert keep["__meta_kubernetes_pod_container_port_name"] == port and port in names
        targets = {rule.get("target_label") for rule in jobs[job_name]["relabel_configs"]}
        assert {"namespace", "pod"} <= targets  # what prometheus-adapter maps to resources
    assert "authorization" in jobs["promptlb-gateway"]  # /_promptlb/metrics needs the token


def test_the_model_pod_runs_the_sidecar_beside_the_model_server() -> None:
    deployment = _one("Deployment", "promptlb-model")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True  # the sidecar reads the model server's RSS
    model, sidecar = _container(deployment, "model"), _container(deployment, "sidecar")
    model_port = next(p["containerPort"] for p in model["ports"] if p["name"] == "http")
    sidecar_port = next(p["containerPort"] for p in sidecar["ports"] if p["name"] == "sidecar")
    flags = _flags(sidecar)
    assert flags["model-url"] == f"http://127.0.0.1:{model_port}"
    assert int(flags["port"]) == sidecar_port and flags["host"] == "0.0.0.0"
    # ready when the sidecar's /health is 200 (model up, warm, not draining)
    probe = sidecar["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and probe["port"] == "sidecar"
    # the token and the signing key come from the Secret, mounted where the flags point
    secret = _one("Secret", "promptlb-secrets")
    volume = next(v for v in pod["volumes"] if v["name"] == "secrets")
    assert volume["secret"]["secretName"] == "promptlb-secrets"
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "secrets")["mountPath"]
    for flag, key in (("token-file", "sidecar-token"), ("sign-key-file", "sign-key")):
        assert flags[flag] == f"{mount}/{key}"
        assert key in secret["stringData"]
        assert key in {item["key"] for item in volume["secret"]["items"]}
    kid, _, key = secret["stringData"]["sign-key"].partition(":")
    assert kid and len(key) >= 16
    # preStop drains through the sidecar with the token, then waits for in-flight answers;
    # the model keeps serving at least as long, and the grace period covers both.
    drain = " ".join(sidecar["lifecycle"]["preStop"]["exec"]["command"])
    assert f"http://127.0.0.1:{sidecar_port}/drain" in drain and "method='POST'" in drain
    # ...from the pod itself, the only place its POSTs are taken from: the token is every pod's.
    assert "--local-control" in sidecar["args"]
    assert f"{mount}/sidecar-token" in drain and "Bearer" in drain
    sidecar_wait = int(re.findall(r"sleep (\d+)", drain)[-1])
    model_wait = int(model["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert model_wait >= sidecar_wait
    assert pod["terminationGracePeriodSeconds"] > model_wait
    # The sidecar reads which process holds the model's port from /proc/PID/fd: only its own
    # user's, so both containers run as one uid (the pod's).
    context = pod["securityContext"]
    assert context["runAsNonRoot"] and context["runAsUser"] == 10001
    assert "runAsUser" not in model.get("securityContext", {})
    assert "runAsUser" not in sidecar.get("securityContext", {})
    # alive while it listens: /metrics and /health answer 401 under --protect-reads
    assert "tcpSocket" in sidecar["livenessProbe"]


def test_the_gateway_config_loads_and_points_at_the_headless_service(tmp_path: Path) -> None:
    configmap = _one("ConfigMap", "promptlb-gateway-config")
    deployment = _one("Deployment", "promptlb-gateway")
    gateway = _container(deployment, "gateway")
    flags = _flags(gateway)
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "promptlb-gateway-config"
    assert volumes["secrets"]["secret"]["secretName"] == "promptlb-secrets"
    [(filename, toml)] = configmap["data"].items()
    assert flags["config"] == f"{mounts['config']}/{filename}"
    port = next(p["containerPort"] for p in gateway["ports"] if p["name"] == "http")
    assert int(flags["port"]) == port
    # A rolling update lets the streams under way finish: the pod's grace covers the gateway's.
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > parse_duration("graceful-shutdown", flags["graceful-shutdown"])

    (tmp_path / filename).write_text(toml)
    config = load_config(tmp_path / filename)  # builds and validates; resolves nothing
    service = _one("Service", "promptlb-model")
    assert service["spec"]["clusterIP"] == "None"  # headless: one A record per ready pod
    disc = config.discovery
    assert disc.mode == "dns"
    namespace = service["metadata"]["namespace"]
    assert disc.name == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    service_ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert (disc.port, disc.sidecar_port) == (service_ports["http"], service_ports["sidecar"])
    model = _container(_one("Deployment", "promptlb-model"), "sidecar")
    assert list(disc.models) == _flags(model)["models"].split(",")
    # every secret the config reads is a key of the Secret, in the mounted folder
    secret = _one("Secret", "promptlb-secrets")
    # Not the sidecar token: it drains sidecars, and their reads are open (no --protect-reads).
    assert config.sidecar_token_file is None
    assert (
        "--protect-reads" not in _container(_one("Deployment", "promptlb-model"), "sidecar")["args"]
    )
    for path in (config.admin_token_file, config.sign_key_file):
        assert path is not None
        folder, _, key = path.rpartition("/")
        assert folder == mounts["secrets"] and key in secret["stringData"]
    assert config.admin_token is None  # no secret in the ConfigMap


def test_the_gateways_share_their_prefix_index_through_the_redis_service(tmp_path: Path) -> None:
    # Two predictive replicas that do not share each know where half of every conversation went.
    configmap = _one("ConfigMap", "promptlb-gateway-config")
    [(filename, toml)] = configmap["data"].items()
    (tmp_path / filename).write_text(toml)
    share = load_config(tmp_path / filename).index_share
    assert share is not None
    url = urlsplit(share.redis)
    service = _one("Service", "promptlb-redis")
    namespace = service["metadata"]["namespace"]
    assert url.hostname == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    [port] = service["spec"]["ports"]
    assert url.port == port["port"]
    redis = _one("Deployment", "promptlb-redis")
    labels = redis["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"] for c in redis["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert port["targetPort"] in ports


def test_the_autoscaler_reads_the_sidecars_own_metrics_through_the_adapter() -> None:
    hpa = _one("HorizontalPodAutoscaler", "promptlb-model")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "promptlb-model")
    wanted = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    # Not NVML's utilisation: continuous batching holds it near 100% from the first stream.
    assert wanted["promptlb_engine_kv_cache_usage_ratio"]["averageValue"] == "800m"
    assert "promptlb_engine_waiting_requests" in wanted
    assert "promptlb_gpu_utilization_ratio" not in wanted
    # the HPA owns the count: a replicas field would reset it on every apply
    assert "replicas" not in _one("Deployment", "promptlb-model")["spec"]
    # one HPA per Deployment: two would fight over its replicas
    assert len([d for d in _all() if d["kind"] == "HorizontalPodAutoscaler"]) == 1

    adapter = _one("ConfigMap", "promptlb-adapter-config")
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    served = {}
    for rule in rules:
        found = re.match(r"(\w+)\{", rule["seriesQuery"])
        assert found is not None
        as_ = rule["name"]["as"].replace("${1}", r"\1")
        served[re.sub(rule["name"]["matches"], as_, found[1])] = found[1]
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert set(wanted) <= set(served)
    # the adapter's series are what the sidecar exports
    source = (ROOT / "sidecar" / "_app.py").read_text()
    for name in served.values():
        assert f'"{name.removeprefix("promptlb_sidecar_")}"' in source or name in source


def test_the_sidecar_names_its_node_as_the_gateways_discovery_does(tmp_path: Path) -> None:
    """The snapshots are signed, and a signed snapshot must name the node the gateway fetched it
    for: under DNS discovery that is the pod's address and the model port."""
    configmap = _one("ConfigMap", "promptlb-gateway-config")
    [(filename, toml)] = configmap["data"].items()
    (tmp_path / filename).write_text(toml)
    config = load_config(tmp_path / filename)
    assert config.sign_key_file is not None and config.discovery.mode == "dns"
    sidecar = _container(_one("Deployment", "promptlb-model"), "sidecar")
    assert _flags(sidecar)["node-name"] == f"$(POD_IP):{config.discovery.port}"
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_the_command_lines_are_ones_promptlb_accepts() -> None:
    from promptlb.sidecar._cli import _parser

    sidecar = _container(_one("Deployment", "promptlb-model"), "sidecar")
    assert sidecar["command"] == ["promptlb-sidecar"]
    args = _parser().parse_args([a.replace("$(POD_IP)", "10.0.0.7") for a in sidecar["args"]])
    assert args.node_name == "10.0.0.7:8000"
    gateway = _container(_one("Deployment", "promptlb-gateway"), "gateway")
    assert gateway["command"] == ["promptlb-gateway"]


def test_the_gateway_waits_for_its_endpoint_to_go_before_it_stops_listening() -> None:
    gateway = _one("Deployment", "promptlb-gateway")
    pod = gateway["spec"]["template"]["spec"]
    container = _container(gateway, "gateway")
    wait = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    graceful = parse_duration("graceful", _flags(container)["graceful-shutdown"])
    assert wait >= 5 and pod["terminationGracePeriodSeconds"] > wait + graceful


def test_the_placeholder_secret_is_not_in_the_applied_set() -> None:
    # Applied, its placeholders pass the token checks: the stack would run on public tokens,
    # and a re-apply would overwrite the real Secret.
    applied = [d for path in FILES for d in load_yaml_documents(path)]
    assert not any(d["kind"] == "Secret" for d in applied)
    assert _one("Secret", "promptlb-secrets")["stringData"]["hf-token"]
