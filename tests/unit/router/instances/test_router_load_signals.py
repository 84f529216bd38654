"""power_of_two and the vLLM load signals it reads."""

from __future__ import annotations

import random
from collections import Counter

from disagg_router.router.config import InstanceConfig
from disagg_router.router.instances.load import backend_load, parse_signals
from disagg_router.router.instances.state import BackendState, LoadSignals
from disagg_router.router.routing.policies.power_of_two import PowerOfTwo

VLLM_METRICS = """
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="0",model_name="other"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
"""


def test_parse_reads_the_kv_cache_size_from_cache_config_info() -> None:
    """vLLM 0.32 labels its size in tokens; older versions give blocks and the block size;
    two engines add up; a page without it says 0 (unknown)."""
    info = "# TYPE vllm:cache_config_info gauge\n"
    new = 'vllm:cache_config_info{block_size="128",engine="%s",kv_cache_size_tokens="8287"} 1.0\n'
    old = 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
    two = parse_signals(VLLM_METRICS + info + new % "0" + new % "1", "tiny", at=5.0)
    assert two is not None and two.kv_tokens == 2 * 8287
    older = parse_signals(VLLM_METRICS + info + old, "tiny", at=5.0)
    assert older is not None and older.kv_tokens == 1600
    plain = parse_signals(VLLM_METRICS, "tiny", at=5.0)
    assert plain is not None and plain.kv_tokens == 0


def _backends(n: int) -> list[BackendState]:
    return [
        BackendState(InstanceConfig(url=f"http://127.0.0.1:{8100 + i}"), "prefill")
        for i in range(n)
    ]


def test_parse_reads_the_models_gauges() -> None:
    s = parse_signals(VLLM_METRICS, "tiny", at=5.0)
    assert s == LoadSignals(waiting=2.0, running=3.0, kv_usage=0.25, at=5.0)
    assert parse_signals("# nothing here\n", "tiny", 0.0) is None
    assert parse_signals("vllm:num_requests_running{ 3", "tiny", 0.0) is None


def test_load_uses_fresh_signals_and_falls_back_to_in_flight() -> None:
    (b,) = _backends(1)
    b.in_flight = 1
    assert backend_load(b, now=10.0, stale_after=6.0) == 1.0  # no signals
    # vLLM saw 5 requests while 2 of them were ours: 3 come from elsewhere
    b.signals = LoadSignals(waiting=2.0, running=3.0, kv_usage=0.25, at=8.0, own_in_flight=2)
    assert backend_load(b, now=10.0, stale_after=6.0) == 1.0 + 3.0 + 0.25
    assert backend_load(b, now=20.0, stale_after=6.0) == 1.0  # stale
    b.in_flight = 9  # our own legs count live, never as of the scrape
    assert backend_load(b, now=10.0, stale_after=6.0) == 9.0 + 3.0 + 0.25
    b.signals = LoadSignals(waiting=0.0, running=1.0, kv_usage=0.0, at=8.0, own_in_flight=4)
    assert backend_load(b, now=10.0, stale_after=6.0) == 9.0  # nothing from elsewhere


def test_power_of_two_spreads_equal_instances() -> None:
    bs = _backends(4)
    p2c = PowerOfTwo(stale_after=6.0, rng=random.Random(1), clock=lambda: 0.0)
    counts = Counter(p2c.choose(bs).url for _ in range(2000))
    assert len(counts) == 4 and all(400 <= n <= 600 for n in counts.values()), counts


def test_power_of_two_avoids_the_loaded_instance() -> None:
    fast, slow = _backends(2)
    slow.signals = LoadSignals(waiting=4.0, running=8.0, kv_usage=0.9, at=0.0)
    p2c = PowerOfTwo(stale_after=6.0, rng=random.Random(2), clock=lambda: 1.0)
    assert all(p2c.choose([fast, slow]) is fast for _ in range(50))
    stale = PowerOfTwo(stale_after=6.0, rng=random.Random(2), clock=lambda: 100.0)
    assert {stale.choose([fast, slow]).url for _ in range(50)} == {fast.url, slow.url}
    slow.signals, slow.in_flight = None, 3
    assert all(p2c.choose([fast, slow]) is fast for _ in range(50))
