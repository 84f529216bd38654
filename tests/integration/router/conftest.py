"""Fixtures for router integration tests: fake vLLM instances on loopback, reset per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devstack.fake_vllm import FakeVllmServer, FakeVllmState, KvFabric, PushIdentity
from tests.integration.router.router_fixtures import MODEL


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, FakeVllmServer]]:
    """Fakes shared by a module, linked by one KV fabric: prefill p0, p1 and decode d0, d1."""
    fabric = KvFabric()
    servers = {
        "p0": FakeVllmServer(
            FakeVllmState(
                MODEL, identity=PushIdentity(engine_id="engine-p0", port=5600), fabric=fabric
            )
        ),
        "p1": FakeVllmServer(
            FakeVllmState(
                MODEL, identity=PushIdentity(engine_id="engine-p1", port=5601), fabric=fabric
            )
        ),
        "d0": FakeVllmServer(FakeVllmState(MODEL, fabric=fabric)),
        "d1": FakeVllmServer(FakeVllmState(MODEL, fabric=fabric)),
    }
    for server in servers.values():
        server.start()
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture
def fake(fakes: dict[str, FakeVllmServer]) -> dict[str, FakeVllmServer]:
    """The shared fakes, reset (no records, default behaviour) for this test."""
    for server in fakes.values():
        server.state.reset()
    return fakes
