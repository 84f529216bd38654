"""kv_aware through a real router on loopback: fake vLLM instances, each with the fake vLLM's KV
event publisher; the router follows the events, routes P by what each instance holds, shows the
streams in /ready and falls back to affinity when a stream goes silent; a hostile publisher
changes nothing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import pytest

from devstack.fake_vllm import FakeVllmServer
from devstack.fakes.kv_hostile import SHAPES, good, hostile
from devstack.fakes.kv_publisher import FakeKvPublisher
from devstack.tiny_model import make_tiny_model
from disagg_router.router.config import settings_from_mapping
from disagg_router.router.routing.kv_index import KvIndex
from disagg_router.router.routing.kv_wire import typed_events
from tests.integration.router.router_fixtures import MODEL, running_router
from tests.support.wait import wait_until

T = TypeVar("T")
BLOCK = 16


class PublisherLoop:
    """An asyncio loop in a thread for the fake publishers (the router has its own)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=10.0)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10.0)
        self.loop.close()


async def _publisher() -> FakeKvPublisher:
    return FakeKvPublisher()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kv") / "tiny")


@pytest.fixture
def publishers() -> Iterator[tuple[PublisherLoop, dict[str, FakeKvPublisher]]]:
    loop = PublisherLoop()
    pubs = {name: loop.run(_publisher()) for name in ("p0", "p1", "d0")}
    yield loop, pubs
    for pub in pubs.values():
        loop.run(pub.close())
    loop.close()


def _stored(tokens: list[int], salt: int) -> bytes:
    """One KVEventBatch payload storing the full blocks of ``tokens``, as vLLM encodes it."""
    full = len(tokens) // BLOCK * BLOCK
    event = {
        "type": "BlockStored",
        "block_hashes": [salt * 1000 + i for i in range(full // BLOCK)],
        "parent_block_hash": None,
        "token_ids": tokens[:full],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgspec.msgpack.encode([time.time(), [event], 0])


def _instance(server: FakeVllmServer, name: str, pub: FakeKvPublisher) -> dict[str, str]:
    return {
        "url": server.url,
        "name": name,
        "kv_events_endpoint": pub.endpoint,
        "kv_replay_endpoint": pub.replay_endpoint,
    }


def _kv_state(url: str) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"{url}/ready", timeout=5).json().get("kv_events", {})
    return found.get(MODEL, {})


def _states(url: str) -> dict[str, str]:
    return {k: v["state"] for k, v in _kv_state(url).get("instances", {}).items()}


def test_prefill_follows_the_cache_and_a_silent_stream_falls_back(
    fake: dict[str, FakeVllmServer],
    publishers: tuple[PublisherLoop, dict[str, FakeKvPublisher]],
    tokenizer_dir: Path,
) -> None:
    loop, pubs = publishers
    settings = settings_from_mapping(
        {
            "models": [MODEL],
            "prefill": {
                "policy": "kv_aware",
                "instances": [
                    _instance(fake["p0"], "p0", pubs["p0"]),
                    _instance(fake["p1"], "p1", pubs["p1"]),
                ],
            },
            "decode": {
                "policy": "kv_aware",
                "instances": [_instance(fake["d0"], "d0", pubs["d0"])],
            },
            "kv_events": {
                "enabled": True,
                "tokenizer": str(tokenizer_dir),
                "probe_interval": 0.3,
                "probe_timeout": 5.0,  # a loaded machine must not look like a dead publisher
            },
            "health": {"interval": 3600},
        }
    )
    prompts = {name: [7 + i + 100 * n for i in range(BLOCK * 6 + 1)] for n, name in enumerate(pubs)}
    with running_router(settings) as router:
        wait_until(lambda: set(_states(router.url).values()) == {"live"}, what="live streams")
        tokenizer_loaded = lambda: _kv_state(router.url)["tokenizer"] == "loaded"  # noqa: E731
        wait_until(tokenizer_loaded, timeout=180.0, what="the tokenizer (transformers import)")
        for n, name in enumerate(("p0", "p1")):
            loop.run(pubs[name].publish(_stored(prompts[name], n), live=False))  # via a probe
        wait_until(
            lambda: all(_kv_state(router.url)["instances"][n]["blocks"] == 6 for n in ("p0", "p1")),
            what="the index to hold each P's blocks",
        )
        for name in ("p1", "p0", "p1"):
            body = {"model": MODEL, "prompt": prompts[name], "max_tokens": 2}
            assert httpx.post(f"{router.url}/v1/completions", json=body).status_code == 200
        got = {
            n: [r.body["prompt"] for r in fake[n].state.generation_requests()] for n in ("p0", "p1")
        }
        assert got["p0"].count(prompts["p0"]) == 1 and got["p1"].count(prompts["p1"]) == 2
        assert prompts["p1"] not in got["p0"] and prompts["p0"] not in got["p1"]
        metrics = httpx.get(f"{router.url}/metrics").text.splitlines()
        predicted = (
            f'disagg_router_kv_predicted_cached_tokens_total{{model="{MODEL}",role="prefill"}}'
        )
        assert f"{predicted} {3 * 6 * BLOCK:.1f}" in metrics  # decided by the index, not affinity
        pubs["p1"].replay_answers = False  # p1's publisher stops answering
        wait_until(
            lambda: _states(router.url).get("p1") == "degraded", timeout=60.0, what="p1 degraded"
        )
        body = {"model": MODEL, "prompt": prompts["p1"], "max_tokens": 2}
        assert httpx.post(f"{router.url}/v1/completions", json=body).status_code == 200
        assert "disagg_router_kv_stream_degraded" in httpx.get(f"{router.url}/metrics").text


def test_a_hostile_publisher_leaves_the_router_as_its_good_events_alone(
    fake: dict[str, FakeVllmServer],
    publishers: tuple[PublisherLoop, dict[str, FakeKvPublisher]],
    tokenizer_dir: Path,
) -> None:
    """Every hostile shape, 10 times among good batches into p0's stream: p0 stays live with
    the good batches' blocks, its task never restarts, /ready and the metrics agree."""
    loop, pubs = publishers
    settings = settings_from_mapping(
        {
            "models": [MODEL],
            "prefill": {"instances": [_instance(fake["p0"], "p0", pubs["p0"])]},
            "decode": {"instances": [_instance(fake["d0"], "d0", pubs["d0"])]},
            # A replay that takes longer than probe_timeout leaves its gap unfilled and the
            # batches in it unread (by design: the instance starts over); replaying these
            # batches (one nested 100,000 deep) can take seconds on a loaded machine, and what
            # is checked here is that every batch read is judged, so replays get all the time.
            "kv_events": {
                "enabled": True,
                "tokenizer": str(tokenizer_dir),
                "probe_interval": 0.3,
                "probe_timeout": 60,
            },
            "health": {"interval": 3600},
        }
    )
    limit = settings.kv_events.max_message_bytes
    shapes = [s for s in SHAPES if s != "10 million hashes"]  # tests/unit: test_kv_hostile.py
    with running_router(settings) as router:
        wait_until(lambda: _states(router.url).get("p0") == "live", what="p0 live")
        wait_until(lambda: pubs["p0"].subscriptions > 0, what="p0 subscribed")
        good_only = KvIndex(max_blocks=100_000)
        for n in range(10):
            for shape in shapes:
                loop.run(pubs["p0"].publish(good(n * 100 + len(shape))))
                good_only.apply("p0", typed_events(good(n * 100 + len(shape)), 65536))
                loop.run(pubs["p0"].publish(hostile(shape, limit)))
        loop.run(pubs["p0"].publish(good(10_000)))
        good_only.apply("p0", typed_events(good(10_000), 65536))
        bad = f'disagg_router_kv_bad_events_total{{instance="p0",model="{MODEL}",reason='
        wait_until(
            lambda: _metric_sum(router.url, bad) == 10 * len(shapes),
            what=f"every hostile batch counted ({10 * len(shapes)})",
            timeout=60.0,
        )
        wait_until(
            lambda: _kv_state(router.url)["instances"]["p0"]["blocks"] == good_only.blocks("p0"),
            what="p0's index as with the good batches alone",
        )
        ready = httpx.get(f"{router.url}/ready", timeout=5).json()
        assert _states(router.url)["p0"] == "live" and ready["degraded"] == []
        metrics = httpx.get(f"{router.url}/metrics").text
        assert _metric_sum(router.url, "disagg_router_kv_stream_failures_total{") == 0
        assert f'disagg_router_kv_stream_degraded{{instance="p0",model="{MODEL}"}} 0.0' in metrics
        assert "disagg_router_degraded 0.0" in metrics


def _metric_sum(url: str, prefix: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))
