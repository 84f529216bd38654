"""The kv_aware policy and the cached D-only rule on an index filled with block stores."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from disagg_router.router.config import (
    DisaggregationConfig,
    InstanceConfig,
    KvEventsConfig,
    ModelRoute,
    PoolConfig,
)
from disagg_router.router.dispatch.orchestrator import CACHED_ON_DECODE, DISAGGREGATED, decide
from disagg_router.router.instances.state import BackendState, Role
from disagg_router.router.observability.metrics import KvMetrics
from disagg_router.router.routing.block_keys import PromptTokenizer
from disagg_router.router.routing.kv_events import (
    EventStream,
    StreamLimits,
    StreamTarget,
    StreamTiming,
)
from disagg_router.router.routing.kv_index import KvIndex
from disagg_router.router.routing.kv_model import KvModel, KvRequest
from disagg_router.router.routing.kv_wire import BlockStored
from disagg_router.router.routing.policies.base import RoutingInput
from disagg_router.router.routing.policies.kv_aware import KvAware
from disagg_router.router.routing.policies.prefix_affinity import PrefixAffinity
from disagg_router.router.routing.pools import Pool
from disagg_router.router.routing.table import ModelPools

BLOCK = 16
PROMPT = list(range(1, 16 * 10 + 2))  # 10 full blocks before the last token


class _NoTextTokenizer:
    """Token-id prompts never reach the tokenizer; a text prompt here is a test error."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        raise AssertionError("not used")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("not used")


def _model(fraction: float = 0.0, registry: CollectorRegistry | None = None) -> KvModel:
    return KvModel(
        "tiny",
        KvEventsConfig(enabled=True, tokenizer="unused", decode_only_fraction=fraction),
        KvMetrics(registry or CollectorRegistry()),
        KvIndex(max_blocks=10_000),
        tokenizer=PromptTokenizer(_NoTextTokenizer(), 8, 65536),
    )


def _backend(name: str, role: Role = "prefill") -> BackendState:
    return BackendState(InstanceConfig(url="http://127.0.0.1:8100", name=name), role)


def _live(model: KvModel, label: str) -> None:
    target = StreamTarget("tiny", label, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "")
    limits = StreamLimits(4 * 1024 * 1024, 65536)
    stream = EventStream(target, model.index, StreamTiming(1.0, 1.0), model.metrics, limits)
    stream.state = "live"
    model.streams[label] = stream


def _holds(model: KvModel, label: str, tokens: list[int]) -> None:
    """``label`` stores the full blocks of ``tokens`` (one BlockStored, as vLLM sends it)."""
    full = len(tokens) // BLOCK * BLOCK
    hashes: list[bytes | int] = [f"{label}-{i}".encode() for i in range(full // BLOCK)]
    event = BlockStored(hashes, tokens[:full], BLOCK, medium="GPU")
    model.index.apply(label, [event])


def _routed(model: KvModel, prompt: list[int] = PROMPT) -> RoutingInput:
    body = {"prompt": prompt}
    return RoutingInput(body, False, {}, KvRequest(model, body, False))


def _cluster(
    role: Role = "prefill", n: int = 3, registry: CollectorRegistry | None = None
) -> tuple[KvModel, list[BackendState]]:
    model = _model(registry=registry)
    backends = [_backend(f"{role[0]}{i}", role) for i in range(n)]
    for b in backends:
        _live(model, b.label)
    return model, backends


def test_prefill_goes_where_the_longest_prefix_is_cached() -> None:
    model, bs = _cluster()
    _holds(model, "p1", PROMPT[: BLOCK * 3])
    _holds(model, "p2", PROMPT[: BLOCK * 8])
    assert KvAware(256, 1.25).choose(bs, _routed(model)).label == "p2"


def test_prefill_cost_counts_the_tokens_queued_there() -> None:
    model, bs = _cluster(n=2)
    _holds(model, "p1", PROMPT[: BLOCK * 2])
    policy = KvAware(256, 10.0)  # no load bound in the way
    other = list(range(5000, 5000 + 16 * 30))  # 480 uncached tokens queued on p1
    bs[0].in_flight = 0
    first = policy.choose([bs[1]], _routed(model, other))
    bs[1].in_flight = 1
    assert first.label == "p1"
    # p1 saves 32 tokens of this prompt but has 480 queued: p0 costs less.
    assert policy.choose(bs, _routed(model)).label == "p0"


def test_the_load_bound_spills_a_hot_prefix() -> None:
    model, bs = _cluster()
    _holds(model, "p2", PROMPT)
    bs[2].in_flight = 5
    assert KvAware(256, 1.25).choose(bs, _routed(model)).label != "p2"


def test_decode_prefers_its_cached_prefix_then_fewer_legs() -> None:
    model, bs = _cluster("decode")
    _holds(model, "d0", PROMPT[: BLOCK * 4])
    assert KvAware(256, 10.0).choose(bs, _routed(model)).label == "d0"
    cold = list(range(9000, 9000 + 200))
    bs[0].in_flight, bs[1].in_flight, bs[2].in_flight = 2, 0, 1
    assert KvAware(256, 10.0).choose(bs, _routed(model, cold)).label == "d1"


def test_two_replicas_with_the_same_events_choose_the_same() -> None:
    model_a, bs_a = _cluster()
    model_b, bs_b = _cluster()
    for model in (model_a, model_b):
        _holds(model, "p0", PROMPT[: BLOCK * 2])
        _holds(model, "p1", list(range(700, 900)))
    prompts = [PROMPT, list(range(700, 1000)), *[list(range(i, i + 300)) for i in range(20)]]
    a, b = KvAware(256, 1.25), KvAware(256, 1.25)
    picks_a = [a.choose(bs_a, _routed(model_a, p)).label for p in prompts]
    picks_b = [b.choose(bs_b, _routed(model_b, p)).label for p in prompts]
    assert picks_a == picks_b
    assert len(set(picks_a)) > 1  # cold prompts spread by their first block


def test_a_degraded_instance_makes_the_pool_route_by_prefix_affinity() -> None:
    model, bs = _cluster()
    _holds(model, "p0", PROMPT)
    model.streams["p1"].state = "degraded"
    routed = _routed(model)
    expected = PrefixAffinity(256, 1.25).choose(bs, routed).label
    assert KvAware(256, 1.25).choose(bs, routed).label == expected


def test_without_kv_events_the_policy_is_prefix_affinity() -> None:
    bs = [_backend(f"p{i}") for i in range(3)]
    for i in range(30):
        routed = RoutingInput({"prompt": f"conversation {i} " * 40})
        assert KvAware(256, 1.25).choose(bs, routed) is PrefixAffinity(256, 1.25).choose(bs, routed)


def test_a_decision_counts_predicted_and_prompt_tokens() -> None:
    registry = CollectorRegistry()
    model, bs = _cluster(registry=registry)
    _holds(model, "p0", PROMPT[: BLOCK * 5])
    assert KvAware(256, 1.25).choose(bs, _routed(model)).label == "p0"
    labels = {"model": "tiny", "role": "prefill"}
    value = registry.get_sample_value
    assert value("disagg_router_kv_predicted_cached_tokens_total", labels) == BLOCK * 5
    assert value("disagg_router_kv_prompt_tokens_total", labels) == len(PROMPT)


def _pools(model: KvModel) -> ModelPools:
    p = PoolConfig(instances=[InstanceConfig(url="http://127.0.0.1:1", name="p0")])
    d = PoolConfig(instances=[InstanceConfig(url="http://127.0.0.1:2", name="d0")])
    route = ModelRoute("tiny", p, d, DisaggregationConfig(), model.config)
    found = ModelPools(route, Pool("prefill", p, False), Pool("decode", d, False))
    _live(model, "d0")
    _live(model, "p0")
    return found


@pytest.mark.parametrize(
    ("fraction", "held_blocks", "expected"),
    [
        (0.8, 9, CACHED_ON_DECODE),
        (0.8, 4, DISAGGREGATED),
        (0.0, 10, DISAGGREGATED),
    ],
)
def test_decode_alone_when_decode_holds_most_of_the_prompt(
    fraction: float, held_blocks: int, expected: str
) -> None:
    model = _model(fraction)
    found = _pools(model)
    _holds(model, "d0", PROMPT[: BLOCK * held_blocks])
    assert decide(found, _routed(model)) == expected
