"""deploy/k8s/data-parallel: the multi-node data-parallel StatefulSet validates against the Kubernetes
schemas (offline, strict), builds with kustomize, runs `llmctl serve` with real flags and as many
replicas as GPUs it requests, puts one pod per node, and its Services and budget select its pods."""

from __future__ import annotations

import yaml

from tests.test_deploy_k8s import (K8S, build, by_kind, config_keys, container, flag_value, load_documents,
                                   needs_kustomize, serve_config_keys, validate)

DP = K8S / "data-parallel"


def resources() -> list[dict]:
    kustomization = yaml.safe_load((DP / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in load_documents(DP / name)]


def test_the_manifests_validate_against_the_kubernetes_schemas():
    docs = resources()
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "PodDisruptionBudget", "Service", "Service",
                                               "StatefulSet"]
    for doc in docs:
        validate(doc)


@needs_kustomize
def test_the_kustomization_builds_into_valid_resources():
    docs = build("data-parallel")
    for doc in docs:
        validate(doc)
    assert all(doc["metadata"]["labels"]["app.kubernetes.io/name"] == "llmctl-dp" for doc in docs)


def test_each_node_serves_one_replica_per_gpu_it_requests_with_real_flags():
    docs = by_kind(resources())
    stateful_set, config_map = docs["StatefulSet"], docs["ConfigMap"]
    c = container(stateful_set)
    assert c["command"] == ["llmctl"] and c["args"][0] == "serve"
    assert {a.lstrip("-").replace("-", "_") for a in c["args"] if a.startswith("--")} <= serve_config_keys()
    assert config_keys(config_map) <= serve_config_keys()
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    gpus = c["resources"]["requests"]["nvidia.com/gpu"]
    assert config["data-parallel-size"] == gpus == c["resources"]["limits"]["nvidia.com/gpu"] > 1
    assert config["device"] == "cuda"
    assert config_map["metadata"]["name"] in {v.get("configMap", {}).get("name")
                                              for v in stateful_set["spec"]["template"]["spec"]["volumes"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    pod = stateful_set["spec"]["template"]["spec"]
    drain = float(flag_value(c["args"], "--shutdown-timeout"))
    assert pod["terminationGracePeriodSeconds"] >= c["lifecycle"]["preStop"]["sleep"]["seconds"] + drain + 5


def test_one_pod_per_node_and_the_services_select_the_pods():
    docs = resources()
    stateful_set = by_kind(docs)["StatefulSet"]
    pod_labels = stateful_set["spec"]["template"]["metadata"]["labels"]
    (anti,) = stateful_set["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert services[stateful_set["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"  # the governing one
    for service in services.values():
        assert service["spec"]["selector"].items() <= pod_labels.items()
    assert stateful_set["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    budget = by_kind(docs)["PodDisruptionBudget"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert budget["spec"]["maxUnavailable"] < stateful_set["spec"]["replicas"]

