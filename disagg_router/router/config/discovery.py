"""Where a pool's instances come from: listed (``static``), DNS records, or the Kubernetes API."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from disagg_router.router.config._base import Frozen


class StaticDiscovery(Frozen):
    """The pool's ``instances`` list is the whole, fixed set (the default)."""

    source: Literal["static"] = "static"


class DnsDiscovery(Frozen):
    """Every A/AAAA record of ``name`` is an instance (a headless Service), re-resolved each
    ``interval``; with ``srv: true`` the SRV records of ``name`` give targets and ports instead.

    ``nameservers`` empty: the system resolver (``/etc/resolv.conf``, with its search domains).
    """

    source: Literal["dns"]
    name: str = Field(min_length=1, description="DNS name, e.g. disagg-decode.ns.svc.cluster.local")
    port: int | None = Field(default=None, ge=1, le=65535, description="instance port (A/AAAA)")
    srv: bool = False
    scheme: Literal["http", "https"] = "http"
    interval: float = Field(default=5.0, gt=0, description="seconds between resolutions")
    timeout: float = Field(default=2.0, gt=0, description="seconds for one resolution")
    nameservers: list[str] = Field(default_factory=list, description="resolver IPs to ask")
    nameserver_port: int = Field(default=53, ge=1, le=65535)
    api_key: str | None = Field(default=None, description="Bearer token for every instance")

    @model_validator(mode="after")
    def _port_source(self) -> DnsDiscovery:
        if self.srv == (self.port is not None):
            raise ValueError("give either port (A/AAAA records) or srv: true (ports from SRV)")
        return self


class KubernetesDiscovery(Frozen):
    """Instances from the Kubernetes API, listed then watched: the ready endpoints of the
    EndpointSlices (``resource: endpointslices``, select a Service's slices with
    ``kubernetes.io/service-name=NAME``) or the ready pods (``resource: pods``) matching
    ``selector`` in ``namespace``. Auth: the pod's service account (``in_cluster``) or a
    kubeconfig file (``kubeconfig``; null path: the client's default)."""

    source: Literal["kubernetes"]
    namespace: str | None = Field(
        default=None, min_length=1, description="null: the router pod's own (in_cluster only)"
    )
    selector: str = Field(min_length=1, description="label selector, e.g. app=vllm,role=decode")
    resource: Literal["endpointslices", "pods"] = "endpointslices"
    port: int | str = Field(description="port number, or (endpointslices) the port's name")
    scheme: Literal["http", "https"] = "http"
    auth: Literal["in_cluster", "kubeconfig"] = "in_cluster"
    kubeconfig: str | None = None
    watch_timeout: float = Field(default=240.0, gt=0, description="seconds one watch call lasts")
    retry_interval: float = Field(default=5.0, gt=0, description="seconds before a relist")
    request_timeout: float = Field(default=30.0, gt=0, description="seconds for one list call")
    api_key: str | None = Field(default=None, description="Bearer token for every instance")

    @field_validator("port")
    @classmethod
    def _port(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 65535:
            raise ValueError("port numbers are 1..65535")
        if isinstance(value, str) and not value:
            raise ValueError("a port name must be non-empty")
        return value

    @model_validator(mode="after")
    def _port_kind(self) -> KubernetesDiscovery:
        if self.resource == "pods" and not isinstance(self.port, int):
            raise ValueError("resource pods needs a port number")
        if self.namespace is None and self.auth != "in_cluster":
            raise ValueError("namespace is required with kubeconfig auth")
        return self


DiscoveryConfig = Annotated[
    StaticDiscovery | DnsDiscovery | KubernetesDiscovery, Field(discriminator="source")
]
