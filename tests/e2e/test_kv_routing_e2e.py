"""KV-aware routing on real vLLM CPU: the router's block keys are the ones vLLM's events publish,
and the cached tokens it predicts are the ones vLLM reports.

One 1P1D stack with our connector, every instance publishing its KV events and reporting cached
prompt tokens; a router with ``kv_aware`` for P and D following those events. The test also
subscribes to P's events itself, to compare what vLLM published with what the router computes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from devstack.stack import Stack, StackOptions
from disagg_router.router.routing.block_keys import PromptTokenizer, load_tokenizer, request_keys
from disagg_router.router.routing.kv_index import KvIndex
from disagg_router.router.routing.kv_wire import BadBatch, KvEvent, typed_events
from tests.e2e.e2e_support import RunningRouter, module_stack, running_router, wait_idle
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("disagg_router.connector.facade") is None,
        reason="disagg_router.connector.facade (our vLLM connector) is not in this checkout",
    ),
]

SYSTEM = "You are the tiny model's assistant; you answer in one short sentence. " * 30


class Subscriber:
    """The test's own subscription to one instance's events, joined like the router's (a replay
    from sequence 0, then the live stream), every batch kept by sequence number, in a thread."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.batches: dict[int, list[KvEvent]] = {}
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay(replay_endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _keep(self, seq: bytes, payload: bytes) -> None:
        with contextlib.suppress(BadBatch):  # recorded real batches decode: test_kv_index.py
            self.batches[int.from_bytes(seq, "big", signed=True)] = typed_events(payload, 65536)

    def _replay(self, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while sock.poll(10_000):
            _, _, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            self._keep(seq, payload)
        sock.close(linger=0)

    def _read(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                _, seq, payload = self._sub.recv_multipart()
                self._keep(seq, payload)

    def index(self) -> KvIndex:
        index = KvIndex(max_blocks=100_000)
        for seq in sorted(dict(self.batches)):
            index.apply("p0", self.batches[seq])
        return index

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sub.close(linger=0)
        self._ctx.term()


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    options = StackOptions(
        kind="ours",
        topology="1p1d",
        kv_events=True,
        extra_args=("--enable-prompt-tokens-details",),
        enforce_eager=True,
    )
    with module_stack(options, e2e_dir) as started:
        yield started


@pytest.fixture(scope="module")
def subscriber(stack: Stack) -> Iterator[Subscriber]:
    endpoints = stack.prefill[0].kv_endpoints
    sub = Subscriber(endpoints["kv_events_endpoint"], endpoints["kv_replay_endpoint"])
    yield sub
    sub.close()


@pytest.fixture(scope="module")
def router(stack: Stack, subscriber: Subscriber) -> Iterator[RunningRouter]:
    with running_router(
        stack, kv_events=True, prefill_policy="kv_aware", decode_policy="kv_aware"
    ) as running:
        wait_until(lambda: _kv_live(running), timeout=240.0, what="live KV event streams")
        yield running


@pytest.fixture(scope="module")
def tokenizer(stack: Stack) -> PromptTokenizer:
    return PromptTokenizer(load_tokenizer(str(stack.model_dir)), 8, 1 << 20)


def _kv_live(router: RunningRouter) -> bool:
    body = httpx.get(router.url + "/ready", timeout=10.0).json()
    kv = body.get("kv_events", {}).get(router.stack.model_name, {})
    states = [i["state"] for i in kv.get("instances", {}).values()]
    return kv.get("tokenizer") == "loaded" and len(states) == 2 and set(states) == {"live"}


def _p_hits(stack: Stack) -> float:
    text = httpx.get(stack.prefill[0].url + "/metrics", timeout=10.0).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total{")
        and 'source="local_cache_hit"' in line
    )


def _send(router: RunningRouter, chat: bool, body: dict[str, Any]) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    full = {"model": router.stack.model_name, "max_tokens": 4, "temperature": 0, **body}
    httpx.post(router.url + path, json=full, timeout=180.0).raise_for_status()


CASES = {
    "completion": (
        False,
        {"prompt": "Tell me about blocks of tokens. " * 60},
        {"prompt": "Tell me about blocks of tokens. " * 60 + "And prefixes, briefly."},
    ),
    "chat": (
        True,
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]},
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello there, how can I help you today?"},
                {"role": "user", "content": "What is a KV cache?"},
            ]
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_router_keys_match_the_events_and_predictions_match_vllm(
    router: RunningRouter, subscriber: Subscriber, tokenizer: PromptTokenizer, case: str
) -> None:
    chat, first, follow_up = CASES[case]
    _send(router, chat, first)
    found = request_keys(tokenizer, first, chat, 128)
    assert found is not None and found[1], "the prompt spans full blocks"
    keys = found[1]
    # What P published holds exactly the router's keys of the first request.
    wait_until(
        lambda: subscriber.index().matched_blocks("p0", keys) == len(keys),
        timeout=30.0,
        what="P's events to store the first request's blocks",
    )
    # Once P is idle it publishes nothing more: the router's index then holds what the events
    # hold (P may store a block or two beyond the keys, in later batches).
    wait_idle(router.stack.prefill[0], 60.0, "P idle after the first request")
    wait_until(
        lambda: _kv_blocks(router, "p0") == subscriber.index().blocks("p0"),
        timeout=30.0,
        what="the router's index to hold P's blocks",
    )
    follow = request_keys(tokenizer, follow_up, chat, 128)
    assert follow is not None
    from_events = 128 * subscriber.index().matched_blocks("p0", follow[1])
    before_router, before_p = _predicted(router, "prefill"), _p_hits(router.stack)
    _send(router, chat, follow_up)
    predicted = _predicted(router, "prefill") - before_router
    reported = _p_hits(router.stack) - before_p
    assert predicted == reported == from_events > 0


def _predicted(router: RunningRouter, role: str) -> float:
    """The router's predicted cached tokens for ``role`` so far."""
    name = "disagg_router_kv_predicted_cached_tokens_total{"
    text = httpx.get(router.url + "/metrics", timeout=10.0).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and f'role="{role}"' in line
    )


def _kv_blocks(router: RunningRouter, label: str) -> int:
    body = httpx.get(router.url + "/ready", timeout=10.0).json()
    instances = body["kv_events"][router.stack.model_name]["instances"]
    blocks: int = instances.get(label, {}).get("blocks", 0)
    return blocks


def _p_prompt_tokens(stack: Stack) -> float:
    text = httpx.get(stack.prefill[0].url + "/metrics", timeout=10.0).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_total{")
    )


def test_a_follow_up_whose_prefix_decode_holds_is_served_by_decode_alone(
    router: RunningRouter, tokenizer: PromptTokenizer
) -> None:
    """D stores the blocks of what it decoded (its KV came from P); with decode_only_fraction,
    the next turn goes to D alone."""
    turn_1 = {"messages": [{"role": "system", "content": "Decode holds this. " * 80}]}
    turn_1["messages"].append({"role": "user", "content": "First?"})
    _send(router, True, turn_1)
    found = request_keys(tokenizer, turn_1, True, 128)
    assert found is not None
    wait_idle(router.stack.decode[0], 60.0, "D idle after the first turn")
    wait_until(
        lambda: _kv_blocks(router, "d0") >= len(found[1]),
        timeout=30.0,
        what="D's events to store the first turn's blocks",
    )
    turn_2 = {"messages": [*turn_1["messages"], {"role": "user", "content": "Second?"}]}
    overrides = {"kv_events": {"decode_only_fraction": 0.5}}
    stack = router.stack
    with running_router(
        stack, overrides, kv_events=True, prefill_policy="kv_aware", decode_policy="kv_aware"
    ) as second:
        wait_until(lambda: _kv_live(second), timeout=240.0, what="live KV event streams")
        wait_until(lambda: _kv_blocks(second, "d0") >= len(found[1]), timeout=30.0, what="D's")
        p_before = _p_prompt_tokens(stack)
        _send(second, True, turn_2)
        metrics = httpx.get(second.url + "/metrics", timeout=10.0).text
    decided = [
        line
        for line in metrics.splitlines()
        if line.startswith("disagg_router_routing_decisions_total{")
        and 'decision="decode_only_cached"' in line
    ]
    assert decided and decided[0].endswith(" 1.0")
    assert _p_prompt_tokens(stack) == p_before  # no P leg
