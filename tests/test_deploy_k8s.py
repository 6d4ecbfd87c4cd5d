"""deploy/k8s: every manifest validates against the Kubernetes schemas (kubernetes-validate, offline,
strict: unknown fields fail), the kustomizations build (kubectl kustomize / kustomize, when
installed), and the Deployment is wired the way the docs promise: the documented resources, probes
on /health, a grace period that covers the drain, the key from a Secret, the config from a
ConfigMap whose keys are `llmctl serve` flags, selectors that match."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import typer
import yaml
from kubernetes_validate.utils import latest_version

from llmctl.cli import app
from llmctl.config import long_flag

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = ("base", "overlays/cpu", "overlays/prometheus-operator")
# Custom resources the Kubernetes schemas do not describe; checked by hand below.
CUSTOM_KINDS = {"ServiceMonitor"}


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


KUSTOMIZE = _kustomize_command()
needs_kustomize = pytest.mark.skipif(KUSTOMIZE is None, reason="neither kustomize nor kubectl is installed "
                                                               "(the plain manifests are still validated)")


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def base_resources() -> list[dict]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in load_documents(BASE / name)]


def build(overlay: str) -> list[dict]:
    proc = subprocess.run([*KUSTOMIZE, str(K8S / overlay)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in docs}


def validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, latest_version(), strict=True)


def serve_config_keys() -> set[str]:
    serve = typer.main.get_command(app).commands["serve"]
    return {long_flag(p).lstrip("-").replace("-", "_") for p in serve.params if p.param_type_name == "option"}


def test_the_plain_manifests_validate_against_the_kubernetes_schemas():
    docs = base_resources()
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    for doc in docs:
        validate(doc)


def test_the_schema_check_rejects_a_misspelt_field():
    deployment = by_kind(base_resources())["Deployment"]
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_kustomization_builds_into_valid_resources(overlay):
    docs = build(overlay)
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            validate(doc)
    assert all(doc["metadata"]["labels"]["app.kubernetes.io/name"] == "llmctl" for doc in docs)


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_deployment_has_the_documented_resources_and_probes():
    c = container(by_kind(base_resources())["Deployment"])
    assert c["resources"] == {"requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": 1},
                              "limits": {"memory": "48Gi", "nvidia.com/gpu": 1}}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model load + warm-up
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": int(flag_value(c["args"], "--port"))}


def test_the_grace_period_covers_pre_stop_and_the_drain():
    deployment = by_kind(base_resources())["Deployment"]
    c = container(deployment)
    drain = float(flag_value(c["args"], "--shutdown-timeout"))
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= pre_stop + drain + 5


def test_the_container_runs_serve_with_real_flags_the_key_file_and_the_config_map():
    deployment = by_kind(base_resources())["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    assert c["command"] == ["llmctl"] and c["args"][0] == "serve"
    flags = {arg.lstrip("-").replace("-", "_") for arg in c["args"] if arg.startswith("--")}
    assert flags <= serve_config_keys()
    assert flag_value(c["args"], "--host") == "0.0.0.0"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    key_file = Path(flag_value(c["args"], "--api-key-file"))
    key_volume = next(name for name, path in mounts.items() if Path(path) == key_file.parent)
    assert volumes[key_volume]["secret"]["secretName"] == "llmctl-api-key"
    assert "--api-key" not in c["args"] and not any(e["name"] == "LLMCTL_API_KEY" and "value" in e
                                                    for e in c.get("env", []))
    config_file = Path(flag_value(c["args"], "--config"))
    config_volume = next(name for name, path in mounts.items() if Path(path) == config_file.parent)
    config_map = by_kind(base_resources())["ConfigMap"]
    assert volumes[config_volume]["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_file.name in config_map["data"]


def config_keys(config_map: dict) -> set[str]:
    return {key.replace("-", "_") for key in yaml.safe_load(config_map["data"]["config.yaml"])}


def test_the_config_map_holds_only_serve_flags():
    keys = config_keys(by_kind(base_resources())["ConfigMap"])
    assert keys and keys <= serve_config_keys()


@needs_kustomize
def test_the_cpu_variant_has_no_gpu_and_runs_on_the_cpu():
    docs = by_kind(build("overlays/cpu"))
    resources = container(docs["Deployment"])["resources"]
    assert "nvidia.com/gpu" not in resources["requests"] and "nvidia.com/gpu" not in resources["limits"]
    assert resources["requests"]["cpu"] == "4" and resources["limits"]["memory"] == "48Gi"
    config = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])
    assert config["device"] == "cpu" and config_keys(docs["ConfigMap"]) <= serve_config_keys()


def test_service_and_disruption_budget_select_the_pods():
    docs = by_kind(base_resources())
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert docs["Deployment"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert docs["Service"]["spec"]["selector"].items() <= pod_labels.items()
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert docs["PodDisruptionBudget"]["spec"]["maxUnavailable"] < docs["Deployment"]["spec"]["replicas"]

@needs_kustomize
def test_the_service_monitor_scrapes_the_service():
    docs = by_kind(build("overlays/prometheus-operator"))
    monitor, service = docs["ServiceMonitor"], docs["Service"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert service["metadata"]["name"] == "llmctl"  # the job label the EngineUnhealthy alert matches
