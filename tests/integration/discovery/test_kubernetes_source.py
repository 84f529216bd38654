"""Kubernetes discovery against the API's wire format: a transcript of EndpointSlice (and pod)
list/watch answers, written in the JSON the API server sends, served over loopback HTTP (no
cluster runs on the test machines), read through kubernetes-asyncio with kubeconfig auth."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from devstack.fake_vllm import UvicornThread
from disagg_router.router.config import InstanceConfig, KubernetesDiscovery
from disagg_router.router.discovery.kubernetes import KubernetesSource
from disagg_router.router.discovery.source import Failed, Found, Update
from disagg_router.router.discovery.watcher import PoolDiscovery
from disagg_router.router.observability.metrics import RouterMetrics
from disagg_router.router.supervisor import Supervisor
from tests.integration.discovery.kube_api import TOKEN, KubeApiTranscript, kubeconfig, recorded

SLICES = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
PODS = "/api/v1/namespaces/llm/pods"
SELECTOR = "kubernetes.io/service-name=disagg-decode"


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[UvicornThread] = []

    def start(api: KubeApiTranscript) -> str:
        servers.append(UvicornThread(api.app).start())
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


def _source(config_file: Path, **extra: object) -> KubernetesSource:
    cfg: dict[str, object] = {"source": "kubernetes", "namespace": "llm", "selector": SELECTOR}
    cfg |= {"port": "http", "auth": "kubeconfig", "kubeconfig": str(config_file)}
    cfg |= {"retry_interval": 0.05, "watch_timeout": 60, **extra}
    return KubernetesSource(KubernetesDiscovery.model_validate(cfg))


async def _take(updates: AsyncGenerator[Update, None], count: int) -> list[Update]:
    out = [await anext(updates) for _ in range(count)]
    await updates.aclose()
    return out


def _pods(update: Update) -> list[str]:
    assert isinstance(update, Found), update
    return [i.label.removeprefix("disagg-decode-") for i in update.instances]


async def test_endpointslices_list_watch_relist_after_expiry(tmp_path: Path, serve: Any) -> None:
    api = KubeApiTranscript(
        SLICES,
        lists=[recorded("endpointslices-list-1.json"), recorded("endpointslices-list-2.json")],
        watches=[
            recorded("endpointslices-watch-1.jsonl"),
            recorded("endpointslices-watch-2.jsonl"),
        ],
    )
    source = _source(kubeconfig(tmp_path / "kubeconfig", serve(api)))
    updates = await _take(source.updates(), 6)
    assert [_pods(u) for u in updates] == [
        ["0", "1"],  # list: decode-2 not ready yet
        ["0", "1", "2"],  # MODIFIED: decode-2 ready (the BOOKMARK before it changed nothing)
        ["0", "1", "2", "3"],  # ADDED: a second slice
        ["1", "2", "3"],  # MODIFIED: decode-0 terminating
        ["1", "2", "3", "4"],  # 410 Gone: relisted
        ["1", "2", "4"],  # DELETED: the second slice
    ]
    first = updates[0]
    assert isinstance(first, Found)
    assert [i.url for i in first.instances] == ["http://127.0.0.2:8000", "http://127.0.0.3:8000"]
    watches = api.requests(watch=True)
    assert [w.query["resourceVersion"] for w in watches] == ["1000", "1100"]
    assert len(api.requests(watch=False)) == 2
    for seen in api.seen:
        assert seen.path == SLICES
        assert seen.query["labelSelector"] == SELECTOR
        assert seen.authorization == f"Bearer {TOKEN}"
    assert all(w.query["allowWatchBookmarks"].lower() == "true" for w in watches)


async def test_api_outage_is_a_failure_then_a_relist(tmp_path: Path, serve: Any) -> None:
    api = KubeApiTranscript(SLICES, lists=[503, recorded("endpointslices-list-1.json")], watches=[])
    source = _source(kubeconfig(tmp_path / "kubeconfig", serve(api)))
    failed, listed = await _take(source.updates(), 2)
    assert isinstance(failed, Failed)
    assert "503" in failed.error
    assert _pods(listed) == ["0", "1"]


async def test_wrong_credentials_are_a_failure(tmp_path: Path, serve: Any) -> None:
    api = KubeApiTranscript(SLICES, lists=[recorded("endpointslices-list-1.json")], watches=[])
    config_file = kubeconfig(tmp_path / "kubeconfig", serve(api))
    config_file.write_text(config_file.read_text().replace(TOKEN, "stolen"))
    (failed,) = await _take(_source(config_file).updates(), 1)
    assert isinstance(failed, Failed)
    assert "401" in failed.error


async def test_pods_running_ready_and_not_deleted(tmp_path: Path, serve: Any) -> None:
    api = KubeApiTranscript(
        PODS, lists=[recorded("pods-list.json")], watches=[recorded("pods-watch.jsonl")]
    )
    config_file = kubeconfig(tmp_path / "kubeconfig", serve(api))
    source = _source(config_file, resource="pods", port=8000, selector="app=prefill")
    updates: Sequence[Update] = await _take(source.updates(), 2)
    labels = [[i.label for i in u.instances] for u in updates if isinstance(u, Found)]
    assert labels == [["disagg-prefill-0"], ["disagg-prefill-0", "disagg-prefill-1"]]
    assert api.seen[0].path == PODS


async def test_an_ended_watch_resumes_from_its_last_version(tmp_path: Path, serve: Any) -> None:
    watch_1 = recorded("endpointslices-watch-1.jsonl")
    api = KubeApiTranscript(
        SLICES,
        lists=[recorded("endpointslices-list-1.json")],
        watches=[watch_1[:2], watch_1[2:3]],  # bookmark + MODIFIED (1002), then ADDED (1003)
    )
    source = _source(kubeconfig(tmp_path / "kubeconfig", serve(api)))
    updates = await _take(source.updates(), 3)
    assert [_pods(u) for u in updates] == [["0", "1"], ["0", "1", "2"], ["0", "1", "2", "3"]]
    assert len(api.requests(watch=False)) == 1, "no relist: the watch resumed"
    assert [w.query["resourceVersion"] for w in api.requests(watch=True)] == ["1000", "1002"]


async def test_an_unexpected_error_in_the_watch_is_a_crash_shown_and_restarted(
    tmp_path: Path, serve: Any
) -> None:
    """A watch event the source cannot read (``endpoints`` not a list) raises an error it does
    not expect: the supervised watcher crashes, the pool keeps its set and shows discovery as
    failing, and the restarted watcher relists and is fine again."""
    added = recorded("endpointslices-watch-1.jsonl")[2]
    garbled = {**added, "object": {**added["object"], "endpoints": "garbled"}}
    api = KubeApiTranscript(
        SLICES, lists=[recorded("endpointslices-list-1.json")], watches=[[garbled], []]
    )
    source = _source(kubeconfig(tmp_path / "kubeconfig", serve(api)))
    applied: list[tuple[str, ...]] = []

    async def apply(instances: Sequence[InstanceConfig]) -> None:
        applied.append(tuple(i.label for i in instances))

    watcher = PoolDiscovery("m/decode", source, apply, RouterMetrics(CollectorRegistry()))
    supervisor = Supervisor(RouterMetrics(CollectorRegistry()), backoff=0.05)
    crashes: list[str] = []
    statuses: list[bool] = []

    def crashed(error: str) -> None:
        watcher.crashed(error)
        crashes.append(error)
        statuses.append(watcher.status().ok)

    task = supervisor.start("discovery m/decode", watcher.run, on_crash=crashed)
    try:
        await _until(lambda: len(api.requests(watch=True)) == 2)  # restarted: relisted, watching
        await _until(lambda: watcher.status().ok)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert len(crashes) == 1 and statuses == [False]
    assert len(api.requests(watch=False)) == 2  # the relist after the restart
    assert len(applied) == 1  # the same set again: nothing to apply


async def _until(done: Any) -> None:
    async def poll() -> None:
        while not done():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), 10)
