"""The P and D processes of the device check, driven by commands from :mod:`bench.device_check`.

Each process owns one KV cache (:mod:`bench.device_kv`) and, in turn, our transfer core on it
(``NixlEndpoint`` + ``PushProducer`` on P, ``NixlEndpoint`` + ``PushConsumer`` on D) and then a
bare NIXL agent (:mod:`bench.bare_nixl`) registering the same memory with the same descriptors.
Commands are ``(name, *args)`` tuples over a pipe; every reply is one object. Imports: the
standard library, torch, the connector's vLLM-free transfer core and NIXL only.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench.bare_nixl import BareNixlEndpoint, positions
from bench.device_kv import CacheShape, KVCache
from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.consumer import PushConsumer
from disagg_router.connector.layout import (
    LayoutSpec,
    descriptors,
    layout_from_kv_caches,
    memory_spans,
)
from disagg_router.connector.nixl_backend import NixlEndpoint, nixl_api
from disagg_router.connector.producer import PushProducer
from disagg_router.connector.specs import RecvSpec, SendSpec

P_ENGINE = "device-check-p"
FOREIGN = ("vllm", "fastapi", "httpx", "pydantic", "uvicorn", "starlette", "router", "devstack")
"""Packages the check must run without (a bare GPU machine has none of them)."""
_POLL_S = 0.0001
_WAIT_S = 120.0


def foreign_modules() -> list[str]:
    """The packages of :data:`FOREIGN` this process has imported."""
    return sorted(name for name in FOREIGN if name in sys.modules)


def _cache(shape: CacheShape, device: str) -> tuple[KVCache, LayoutSpec]:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    cache = KVCache(shape, device)
    return cache, layout_from_kv_caches(cache.views, shape.num_blocks, block_size=shape.block_size)


def _bare(name: str, layout: LayoutSpec) -> BareNixlEndpoint:
    dev = layout.device_id
    spans = [(addr, length, dev) for addr, length in memory_spans(layout)]
    return BareNixlEndpoint(name, descriptors(layout), layout.mem_type, spans=spans)


class _Agents:
    """This side's connector (transfer core + endpoint), replaced by a bare agent on request."""

    def __init__(
        self, name: str, layout: LayoutSpec, core: PushProducer | PushConsumer, ep: NixlEndpoint
    ) -> None:
        self._name, self._layout, self._core, self._ep = name, layout, core, ep
        self.bare: BareNixlEndpoint | None = None

    def to_bare(self) -> BareNixlEndpoint:
        self._core.close()
        self._ep.close()
        self.bare = _bare(f"{self._name}-bare", self._layout)
        return self.bare

    def close(self) -> None:
        if self.bare is not None:
            self.bare.close()
            return
        self._core.close()
        self._ep.close()


def _hello(layout: LayoutSpec, **extra: Any) -> dict[str, Any]:
    return {"layout": layout.to_json(), "nixl": nixl_api().__name__, **extra}


def _polled(config: ConnectorConfig, poll_s: float | None) -> ConnectorConfig:
    """``config`` with both poll cadences set to ``poll_s`` (None: the connector's defaults)."""
    if poll_s is None:
        return config
    return dataclasses.replace(config, writer_poll_s=poll_s, receiver_poll_s=poll_s)


def producer_main(
    conn: Connection, shape: CacheShape, device: str, poll_s: float | None = None
) -> None:
    """P: serve ``finish``, then ``bare_open``/``bare_connect``/``bare_write``, until ``exit``."""
    cache, layout = _cache(shape, device)
    cache.fill_pattern()
    endpoint = NixlEndpoint("device-check-p", layout)
    config = _polled(
        ConnectorConfig(side_channel_port=0, lease_s=300.0, registration_ttl_s=300.0), poll_s
    )
    producer = PushProducer(endpoint, P_ENGINE, config)
    agents = _Agents("device-check-p", layout, producer, endpoint)
    conn.send(_hello(layout, port=producer.port))
    bare: BareNixlEndpoint | None = None
    while (cmd := conn.recv())[0] != "exit":
        name, args = cmd[0], cmd[1:]
        if name == "finish":
            t0 = time.monotonic()
            producer.add_finished(SendSpec(f"p{args[0]}", f"k{args[0]}", tuple(args[1])))
            conn.send(t0)
        elif name == "bare_open":
            bare = agents.to_bare()
            conn.send(bare.metadata())
        elif name == "bare_connect" and bare is not None:
            d_layout = LayoutSpec.from_json(args[1])
            bare.connect(args[0], descriptors(d_layout), d_layout.mem_type)
            conn.send(True)
        elif name == "bare_write" and bare is not None:
            local, remote = positions(args[1]), positions(args[2])
            t0 = time.monotonic()
            handle = bare.write(local, f"bare-{args[0]}".encode(), remote_ids=remote)
            conn.send(t0)
            while (state := bare.state(handle)) == "PROC":
                time.sleep(0)
            bare.release(handle)
            if state != "DONE":
                raise RuntimeError(f"bare WRITE ended in state {state}")
    agents.close()
    conn.send(foreign_modules())


def consumer_main(
    conn: Connection, shape: CacheShape, device: str, poll_s: float | None = None
) -> None:
    """D: serve ``register``/``wait``/``verify``, then ``bare_open``/``bare_wait``, until
    ``exit``."""
    cache, layout = _cache(shape, device)
    endpoint = NixlEndpoint("device-check-d", layout)
    config = _polled(ConnectorConfig(transfer_timeout_s=_WAIT_S), poll_s)
    consumer = PushConsumer(endpoint, config)
    agents = _Agents("device-check-d", layout, consumer, endpoint)
    conn.send(_hello(layout))
    bare: BareNixlEndpoint | None = None
    results: dict[str, bool] = {}
    while (cmd := conn.recv())[0] != "exit":
        name, args = cmd[0], cmd[1:]
        if name == "register":
            i, port, blocks = args
            spec = RecvSpec(f"d{i}", f"k{i}", P_ENGINE, "127.0.0.1", port, tuple(blocks), 0)
            consumer.register(spec).result(timeout=_WAIT_S)
            conn.send(True)
        elif name == "wait":
            conn.send(_wait_connector(consumer, f"d{args[0]}", results))
        elif name == "verify":
            d_blocks, p_blocks, written = args
            conn.send(
                {"exact": cache.holds(d_blocks, p_blocks), "rest_zero": cache.zero_except(written)}
            )
        elif name == "bare_open":
            bare = agents.to_bare()
            conn.send(bare.metadata())
        elif name == "bare_wait" and bare is not None:
            conn.send(_wait_bare(bare, f"bare-{args[0]}".encode()))
    agents.close()
    conn.send(foreign_modules())


def _wait_connector(
    consumer: PushConsumer, rid: str, results: dict[str, bool]
) -> tuple[float, bool]:
    """``(when D learnt it, ok)`` for ``rid``, polling like vLLM's engine loop would."""
    deadline = time.monotonic() + _WAIT_S
    while rid not in results:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rid}: no result within {_WAIT_S} s")
        finished, failed = consumer.take_results()
        results.update({r: r not in failed for r in finished})
        if rid not in results:
            time.sleep(_POLL_S)
    return time.monotonic(), results.pop(rid)


def _wait_bare(bare: BareNixlEndpoint, want: bytes) -> tuple[float, bool]:
    deadline = time.monotonic() + _WAIT_S
    while want not in bare.notifs():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{want!r}: no notification within {_WAIT_S} s")
        time.sleep(_POLL_S)
    return time.monotonic(), True
