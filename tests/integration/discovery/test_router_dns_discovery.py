"""The router over DNS-discovered pools: a real DNS server (dnsmasq) whose records change while
traffic runs to fake vLLM instances on loopback addresses 127.0.0.2-6 (one port each role).

Instances are added (before they even run: they join only once their health check, and for P the
identity probe, passes) and removed (drained: no new legs, legs in flight finish) mid-run, with
no failed request. Two router replicas over the same records send a prefix to the same P.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.fake_vllm import FakeVllmServer, FakeVllmState, KvFabric, PushIdentity, UvicornThread
from devstack.ports import free_port
from disagg_router.router.config import RouterSettings, settings_from_mapping
from disagg_router.router.http.app import create_app
from tests.integration.discovery.dns_server import DOMAIN, LISTEN, DnsServer
from tests.integration.discovery.traffic import Traffic
from tests.support.wait import wait_until

MODEL = "fake-model"
P_NAME, D_NAME = f"prefill.{DOMAIN}", f"decode.{DOMAIN}"


def _settings(dns: DnsServer, p_port: int, d_port: int, policy: str) -> RouterSettings:
    def pool(name: str, port: int) -> dict[str, Any]:
        discovery = {"source": "dns", "name": name, "port": port, "interval": 0.1, "timeout": 1}
        discovery |= {"nameservers": [LISTEN], "nameserver_port": dns.port}
        return {"policy": policy, "discovery": discovery}

    return settings_from_mapping(
        {
            "models": [MODEL],
            "mode": "push",
            "prefill": pool(P_NAME, p_port),
            "decode": pool(D_NAME, d_port),
            "health": {"interval": 3600, "unhealthy_interval": 0.1},
        }
    )


class Fleet:
    """Fake P (identity engine-<addr>) and D instances on loopback addresses, one KV fabric."""

    def __init__(self, stack: ExitStack) -> None:
        self.p_port, self.d_port = free_port("127.0.0.2"), free_port("127.0.0.4")
        self.fabric = KvFabric()
        self.servers: dict[str, FakeVllmServer] = {}
        self._stack = stack

    def start(self, role: str, address: str) -> FakeVllmServer:
        identity = PushIdentity(engine_id=f"engine-{address}", host=address)
        state = FakeVllmState(MODEL, identity=identity if role == "p" else None, fabric=self.fabric)
        port = self.p_port if role == "p" else self.d_port
        server = FakeVllmServer(state, port=port, host=address)
        self.servers[address] = self._stack.enter_context(server)
        return server


def _ready(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/ready", timeout=5).json()
    return body


def _usable(url: str) -> tuple[list[str], list[str]]:
    body = _ready(url)
    return [a.split(":")[0] for a in body["prefill"]], [a.split(":")[0] for a in body["decode"]]


def _legs(server: FakeVllmServer) -> list[Any]:
    return server.state.generation_requests()


def _is_probe(record: Any) -> bool:
    return bool(record.body.get("kv_transfer_params", {}).get("identity_probe"))


@pytest.fixture
def dns(tmp_path: Path) -> Iterator[DnsServer]:
    with DnsServer(tmp_path) as server:
        yield server


def test_instances_join_after_checks_and_leave_drained_under_traffic(dns: DnsServer) -> None:
    with ExitStack() as stack:
        fleet = Fleet(stack)
        p2, d4 = fleet.start("p", "127.0.0.2"), fleet.start("d", "127.0.0.4")
        d5 = fleet.start("d", "127.0.0.5")
        dns.set_hosts({P_NAME: ["127.0.0.2"], D_NAME: ["127.0.0.4", "127.0.0.5"]})
        settings = _settings(dns, fleet.p_port, fleet.d_port, "round_robin")
        router = stack.enter_context(UvicornThread(create_app(settings)))
        wait_until(
            lambda: _usable(router.url) == (["127.0.0.2"], ["127.0.0.4", "127.0.0.5"]),
            timeout=15,
            what="the first discovered set to pass its checks",
        )
        traffic = Traffic(router.url, MODEL).start()
        try:
            _add_instances_before_they_run(dns, fleet, router.url, traffic)
            removed_at = _remove_instances(dns, router.url, traffic)
        finally:
            results = traffic.stop()
        assert [s for s in results if s.status != 200] == [], "no request failed"
        late = {s.request_id for s in results if s.sent_at > removed_at}
        assert len(late) >= 20
        for gone in (p2, d4):  # drained: nothing sent after the removal reached them
            assert not late & {r.headers.get("x-request-id") for r in _legs(gone)}
            assert gone.state.in_flight == 0
        p3, d6 = fleet.servers["127.0.0.3"], fleet.servers["127.0.0.6"]
        assert _is_probe(_legs(p3)[0]), "the new P was probed before its first leg"
        assert late & {r.headers.get("x-request-id") for r in _legs(d6)}
        assert len(_legs(d5)) > 0


def _add_instances_before_they_run(
    dns: DnsServer, fleet: Fleet, url: str, traffic: Traffic
) -> None:
    dns.set_hosts({P_NAME: ["127.0.0.2", "127.0.0.3"], D_NAME: [f"127.0.0.{i}" for i in (4, 5, 6)]})

    def discovered() -> bool:
        found = _ready(url)["discovery"][MODEL]
        return len(found["prefill"]["instances"]) == 2 and len(found["decode"]["instances"]) == 3

    wait_until(discovered, timeout=15, what="the router to discover 127.0.0.3 and 127.0.0.6")
    # Known but not running: not used, and the traffic goes on without them.
    assert _usable(url) == (["127.0.0.2"], ["127.0.0.4", "127.0.0.5"])
    seen = len(traffic.done())
    wait_until(lambda: len(traffic.done()) >= seen + 10, timeout=30, what="traffic to go on")
    assert _usable(url) == (["127.0.0.2"], ["127.0.0.4", "127.0.0.5"])
    p3, d6 = fleet.start("p", "127.0.0.3"), fleet.start("d", "127.0.0.6")
    wait_until(
        lambda: len(_usable(url)[0]) == 2 and len(_usable(url)[1]) == 3,
        timeout=15,
        what="the new instances to pass their checks",
    )
    wait_until(
        lambda: len(_legs(p3)) > 3 and len(_legs(d6)) > 3,
        timeout=30,
        what="the new instances to get legs",
    )


def _remove_instances(dns: DnsServer, url: str, traffic: Traffic) -> float:
    """Drop 127.0.0.2 (P) and 127.0.0.4 (D) from DNS; the time the router had dropped them."""
    dns.set_hosts({P_NAME: ["127.0.0.3"], D_NAME: ["127.0.0.5", "127.0.0.6"]})
    wait_until(
        lambda: _usable(url) == (["127.0.0.3"], ["127.0.0.5", "127.0.0.6"]),
        timeout=15,
        what="the router to drop the removed instances",
    )
    removed_at = time.monotonic()
    wait_until(
        lambda: traffic.completed_after(removed_at) >= 20,
        timeout=30,
        what="traffic after the removal",
    )
    return removed_at


def _which(fleet: Fleet, addresses: list[str], request_id: str) -> str:
    """The one of ``addresses`` whose fake received a leg of ``request_id``."""
    (address,) = [
        a
        for a in addresses
        if request_id in {r.headers.get("x-request-id") for r in _legs(fleet.servers[a])}
    ]
    return address


def _in_flight(url: str, backend: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    line = f'disagg_router_backend_in_flight{{backend="{backend}",role="prefill"}} '
    values = [float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)]
    return values[0] if values else 0.0


def test_two_replicas_send_a_prefix_to_the_same_prefill(dns: DnsServer) -> None:
    with ExitStack() as stack:
        fleet = Fleet(stack)
        p_addresses = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        for address in p_addresses:
            fleet.start("p", address)
        fleet.start("d", "127.0.0.5")
        dns.set_hosts({P_NAME: p_addresses, D_NAME: ["127.0.0.5"]})
        settings = _settings(dns, fleet.p_port, fleet.d_port, "prefix_affinity")
        replicas = [stack.enter_context(UvicornThread(create_app(settings))) for _ in range(2)]
        for replica in replicas:
            wait_until(
                lambda r=replica: _usable(r.url) == (p_addresses, ["127.0.0.5"]),
                timeout=15,
                what="both replicas to discover and check every instance",
            )
        chosen: dict[str, list[str]] = {}
        for n in range(12):
            prompt = f"system prompt {n} " + "x" * 64
            for replica in replicas:
                response = httpx.post(
                    f"{replica.url}/v1/completions",
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                    timeout=30,
                )
                assert response.status_code == 200, response.text
                chosen.setdefault(prompt, []).append(
                    _which(fleet, p_addresses, response.headers["x-request-id"])
                )
        assert all(a == b for a, b in chosen.values()), chosen
        assert len({a for a, _ in chosen.values()}) > 1, "the prefixes spread over the P"


def test_in_flight_counts_are_per_replica(dns: DnsServer) -> None:
    """Each replica counts only its own legs (and checks health on its own)."""
    with ExitStack() as stack:
        fleet = Fleet(stack)
        p2 = fleet.start("p", "127.0.0.2")
        d5 = fleet.start("d", "127.0.0.5")
        # D waits for the held prefill's KV longer than the client waits for its answer, so the
        # only way the held request ends is the client giving up.
        d5.state.behavior.kv_wait_timeout_s = 60.0
        dns.set_hosts({P_NAME: ["127.0.0.2"], D_NAME: ["127.0.0.5"]})
        settings = _settings(dns, fleet.p_port, fleet.d_port, "round_robin")
        a, b = (stack.enter_context(UvicornThread(create_app(settings))) for _ in range(2))
        for replica in (a, b):
            wait_until(
                lambda r=replica: _usable(r.url) == (["127.0.0.2"], ["127.0.0.5"]),
                timeout=15,
                what="both replicas to be ready",
            )
        p2.state.behavior.hang = True
        p2.state.behavior.fail_times = 1
        label = f"127.0.0.2:{fleet.p_port}"
        body = {"model": MODEL, "prompt": "held", "max_tokens": 2}
        # The client gives up after 5 s (the router then cancels the held leg).
        outcome: list[BaseException | int] = []
        held = threading.Thread(target=_post_held, args=(a.url, body, outcome), daemon=True)
        held.start()
        wait_until(lambda: _in_flight(a.url, label) == 1, timeout=15, what="a to count its leg")
        assert _in_flight(b.url, label) == 0
        held.join(timeout=30)
        assert len(outcome) == 1 and isinstance(outcome[0], httpx.ReadTimeout), outcome
        wait_until(lambda: p2.state.in_flight == 0, timeout=15, what="the held leg to end")


def _post_held(url: str, body: dict[str, Any], outcome: list[BaseException | int]) -> None:
    """POST a request the fleet holds; record the status or the client's error in ``outcome``."""
    try:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(5.0))
    except httpx.HTTPError as exc:
        outcome.append(exc)
        return
    outcome.append(response.status_code)
