"""Discovery sections of the pool config: valid forms load, mistakes name their field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import certifi
import pytest
from kubernetes_asyncio.config import incluster_config
from kubernetes_asyncio.config.config_exception import ConfigException

from disagg_router.router.config import (
    DnsDiscovery,
    KubernetesDiscovery,
    StaticDiscovery,
    settings_from_mapping,
)
from disagg_router.router.discovery.kubernetes import api_client, namespace
from disagg_router.router.errors import ConfigError


def _settings(prefill: dict[str, Any]) -> Any:
    return settings_from_mapping(
        {
            "models": ["m"],
            "prefill": prefill,
            "decode": {"instances": [{"url": "http://127.0.0.1:2"}]},
        }
    )


def test_static_is_the_default_and_needs_instances() -> None:
    settings = _settings({"instances": [{"url": "http://127.0.0.1:1"}]})
    assert settings.prefill.discovery == StaticDiscovery()
    with pytest.raises(ConfigError) as err:
        _settings({"instances": []})
    assert err.value.field == "prefill.instances"
    assert "at least one instance" in err.value.message


def test_dns_and_kubernetes_sources_load() -> None:
    dns = _settings({"discovery": {"source": "dns", "name": "p.ns.svc", "port": 8000}})
    assert isinstance(dns.prefill.discovery, DnsDiscovery)
    assert (dns.prefill.discovery.interval, dns.prefill.discovery.nameservers) == (5.0, [])
    kube = _settings(
        {
            "discovery": {
                "source": "kubernetes",
                "namespace": "llm",
                "selector": "a=b",
                "port": "http",
            }
        }
    )
    assert isinstance(kube.prefill.discovery, KubernetesDiscovery)
    assert (kube.prefill.discovery.resource, kube.prefill.discovery.auth) == (
        "endpointslices",
        "in_cluster",
    )


@pytest.mark.parametrize(
    ("discovery", "field", "words"),
    [
        ({"source": "dns", "name": "p"}, "prefill.discovery.dns", "either port"),
        ({"source": "dns", "name": "p", "port": 1, "srv": True}, "prefill.discovery.dns", "either"),
        (
            {"source": "dns", "name": "p", "port": 1, "interval": 0},
            "prefill.discovery.dns.interval",
            "",
        ),
        ({"source": "consul"}, "prefill.discovery", "tag"),
        (
            {
                "source": "kubernetes",
                "namespace": "n",
                "selector": "a=b",
                "port": "http",
                "resource": "pods",
            },
            "prefill.discovery.kubernetes",
            "port number",
        ),
        (
            {"source": "kubernetes", "namespace": "n", "selector": "a=b", "port": 0},
            "prefill.discovery.kubernetes.port",
            "1..65535",
        ),
    ],
)
def test_bad_discovery_names_the_field(discovery: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _settings({"discovery": discovery})
    assert err.value.field == field
    assert words in err.value.message


def test_a_discovered_pool_lists_no_instances() -> None:
    with pytest.raises(ConfigError) as err:
        _settings(
            {
                "discovery": {"source": "dns", "name": "p", "port": 1},
                "instances": [{"url": "http://127.0.0.1:1"}],
            }
        )
    assert err.value.field == "prefill.instances"
    assert "lists no instances" in err.value.message


def test_kubernetes_namespace_defaults_to_the_pods_own(tmp_path: Path) -> None:
    own = tmp_path / "namespace"
    own.write_text("llm\n")
    cfg = {"source": "kubernetes", "selector": "a=b", "port": "http"}
    assert namespace(KubernetesDiscovery.model_validate(cfg), own) == "llm"
    assert namespace(KubernetesDiscovery.model_validate(cfg | {"namespace": "x"}), own) == "x"
    with pytest.raises(ConfigException):
        namespace(KubernetesDiscovery.model_validate(cfg), tmp_path / "missing")
    with pytest.raises(ConfigError) as err:
        _settings({"discovery": cfg | {"auth": "kubeconfig"}})
    assert "namespace is required" in err.value.message


async def test_in_cluster_auth_reads_the_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a pod provides (env host/port, token and CA files) becomes the client's config."""
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("sa-token")
    ca.write_text(Path(certifi.where()).read_text())  # any valid CA bundle
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    cfg = KubernetesDiscovery.model_validate(
        {"source": "kubernetes", "selector": "a=b", "port": "http"}
    )
    client = await api_client(cfg)
    try:
        conf = client.configuration
        assert conf.host == "https://127.0.0.1:6443"
        assert conf.api_key["BearerToken"] == "Bearer sa-token"
        assert conf.ssl_ca_cert == str(ca)
    finally:
        await client.close()
