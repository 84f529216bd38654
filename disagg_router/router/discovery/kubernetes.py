"""Kubernetes discovery: list, then watch, EndpointSlices or pods selected by labels.

The source lists ``resource`` in ``namespace`` (default: the router pod's own) with the label
``selector``, yields the set, then watches from the list's resourceVersion and yields the set after
every event. A watch that ends
(its ``watch_timeout``) is resumed from the last resourceVersion; an expired one (410 Gone) is
answered by a fresh list; any other error yields :class:`Failed` and a relist after
``retry_interval``. Objects are read in the API's JSON form (``raw_object``), so the parsing here
is the wire format, whatever the client's models do.

Which endpoints count: an EndpointSlice endpoint whose ``conditions.ready`` is not false (the API
says unset means ready; a terminating pod is not ready), with the port numbered or named in the
config, address types IPv4/IPv6; a pod that is Running, has an IP, its Ready condition True and no
deletionTimestamp. Labels are pod names (an endpoint without a pod reference: its address:port).
The client is kubernetes-asyncio, authenticated in-cluster (service account) or by kubeconfig.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterable
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from disagg_router.router.config import InstanceConfig, KubernetesDiscovery
from disagg_router.router.discovery.source import Failed, Found, Update, base_url, found

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_GONE = 410
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_ERRORS = (ApiException, aiohttp.ClientError, TimeoutError, ConfigException, KeyError, TypeError)


def namespace(cfg: KubernetesDiscovery, own: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """The configured namespace, else the router pod's own (from its service account)."""
    if cfg.namespace is not None:
        return cfg.namespace
    try:
        return own.read_text().strip()
    except OSError as exc:
        raise ConfigException(f"no namespace configured and {own} unreadable") from exc


async def api_client(cfg: KubernetesDiscovery) -> Any:
    """A kubernetes-asyncio ``ApiClient`` authenticated as configured (close it when done)."""
    configuration = client.Configuration()
    if cfg.auth == "in_cluster":
        config.load_incluster_config(client_configuration=configuration)
    else:
        await config.load_kube_config(
            config_file=cfg.kubeconfig, client_configuration=configuration, persist_config=False
        )
    return client.ApiClient(configuration=configuration)


class KubernetesSource:
    kind = "kubernetes"

    def __init__(self, cfg: KubernetesDiscovery) -> None:
        self.config = cfg

    async def updates(self) -> AsyncGenerator[Update, None]:
        """List and watch forever; a failure yields :class:`Failed`, then a relist later."""
        while True:
            try:
                async with await api_client(self.config) as api:
                    while True:  # a 410 ends one sync; relist at once
                        async for update in self._sync(api):
                            yield update
            except _ERRORS as exc:
                yield Failed(f"kubernetes {self.config.resource}: {_describe(exc)}")
            await asyncio.sleep(self.config.retry_interval)

    def _list_call(self, api: Any) -> Any:
        if self.config.resource == "pods":
            return client.CoreV1Api(api).list_namespaced_pod
        return client.DiscoveryV1Api(api).list_namespaced_endpoint_slice

    async def _sync(self, api: Any) -> AsyncGenerator[Found, None]:
        """One list, then watches from its resourceVersion until the version expires (410)."""
        cfg = self.config
        list_call = self._list_call(api)
        ns = namespace(cfg)
        listed = await list_call(
            ns, label_selector=cfg.selector, _request_timeout=cfg.request_timeout
        )
        body: Obj = api.sanitize_for_serialization(listed)
        objects = {_key(o): o for o in body.get("items") or []}
        version: str = body["metadata"]["resourceVersion"]
        yield self._found(objects.values())
        while True:
            async with watch.Watch() as stream:
                try:
                    async for event in stream.stream(
                        list_call,
                        ns,
                        label_selector=cfg.selector,
                        resource_version=version,
                        timeout_seconds=int(cfg.watch_timeout),
                        allow_watch_bookmarks=True,
                        _request_timeout=cfg.watch_timeout + cfg.request_timeout,
                    ):
                        if _apply(objects, event["type"], event["raw_object"]):
                            yield self._found(objects.values())
                except ApiException as exc:
                    if exc.status != _GONE:
                        raise
                    log.info("kubernetes watch expired (%s); relisting", exc.reason)
                    return
                version = stream.resource_version or version

    def _found(self, objects: Iterable[Obj]) -> Found:
        if self.config.resource == "pods":
            return found(i for o in objects for i in self._from_pod(o))
        return found(i for o in objects for i in self._from_slice(o))

    def _instance(self, address: str, port: int, name: str | None) -> InstanceConfig:
        url = base_url(self.config.scheme, address, port)
        label = name or url.split("://", 1)[1]
        return InstanceConfig(url=url, name=label, api_key=self.config.api_key)

    def _from_slice(self, obj: Obj) -> list[InstanceConfig]:
        if obj.get("addressType") not in ("IPv4", "IPv6"):
            return []
        port = self._slice_port(obj)
        if port is None:
            return []
        out = []
        for endpoint in obj.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            pod = (endpoint.get("targetRef") or {}).get("name")
            out += [self._instance(a, port, pod) for a in endpoint.get("addresses") or []]
        return out

    def _slice_port(self, obj: Obj) -> int | None:
        wanted = self.config.port
        if isinstance(wanted, int):
            return wanted
        ports = [p for p in obj.get("ports") or [] if p.get("name") == wanted and p.get("port")]
        return int(ports[0]["port"]) if ports else None

    def _from_pod(self, obj: Obj) -> list[InstanceConfig]:
        status = obj.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        meta = obj["metadata"]
        if status.get("phase") != "Running" or not ready or meta.get("deletionTimestamp"):
            return []
        ip = status.get("podIP")
        assert isinstance(self.config.port, int)  # config: pods need a port number
        return [self._instance(ip, self.config.port, meta["name"])] if ip else []


def _key(obj: Obj) -> str:
    meta = obj["metadata"]
    return str(meta.get("uid") or meta["name"])


def _apply(objects: dict[str, Obj], kind: str, obj: Obj) -> bool:
    """Fold one watch event into ``objects``; True when the set may have changed."""
    if kind == "BOOKMARK":
        return False
    if kind == "DELETED":
        objects.pop(_key(obj), None)
    elif kind in ("ADDED", "MODIFIED"):
        objects[_key(obj)] = obj
    else:
        raise TypeError(f"unexpected watch event type {kind!r}")
    return True


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"API answered {exc.status} {exc.reason}"
    return f"{exc.__class__.__name__}: {exc}"
