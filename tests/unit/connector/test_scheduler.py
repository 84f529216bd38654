"""Scheduler side with vLLM's real ``Request``, ``KVCacheBlocks`` and ``KVCacheBlock`` objects."""

from __future__ import annotations

from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from disagg_router.connector.contract import (
    EngineShape,
    base_request_id,
    identity_probe_params,
    prefill_leg_params,
    read_engine_shape,
    read_prefill_answer,
)
from disagg_router.connector.scheduler import PushScheduler
from disagg_router.connector.specs import KeyCancel, RecvSpec, SendAbort, SendSpec

P_IDENTITY = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "p0",
    "remote_host": "127.0.0.1",
    "remote_port": 18250,
    "tp_size": 1,
    "pp_size": 1,
    "remote_request_id": "cmpl-x-0",
}


def make_request(rid: str, n_tokens: int, params: dict[str, Any] | None) -> Request:
    extra = {"kv_transfer_params": dict(params)} if params is not None else None
    sp = SamplingParams(max_tokens=8, extra_args=extra)
    return Request(rid, list(range(n_tokens)), sp, None)


def blocks(cached: list[int], new: list[int]) -> KVCacheBlocks:
    out = []
    for b in cached:
        blk = KVCacheBlock(b)
        blk._block_hash = b"h%d" % b  # a prefix-cache hit has a hash
        out.append(blk)
    out += [KVCacheBlock(b) for b in new]
    return KVCacheBlocks((out,))


def sched() -> PushScheduler:
    return PushScheduler("d0", "127.0.0.1", 18251, 128)


def test_d_reports_prompt_beyond_local_hit_as_async_and_registers_new_blocks() -> None:
    s = sched()
    req = make_request("cmpl-abc-0-0123abcd", 300, P_IDENTITY | {"transfer_id": "abc"})
    assert s.get_num_new_matched_tokens(req, 0) == (300, True)
    assert s.get_num_new_matched_tokens(req, 128) == (172, True)  # D's own prefix hit
    s.update_state_after_alloc(req, blocks([7], [3, 9]), 172)
    meta = s.build_connector_meta()
    assert meta.registrations == [
        RecvSpec("cmpl-abc-0-0123abcd", "t:abc", "p0", "127.0.0.1", 18250, (3, 9), 1)
    ]
    # Registered once: a second allocation call or a re-query does nothing.
    s.update_state_after_alloc(req, blocks([7], [3, 9, 11]), 0)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.build_connector_meta().registrations == []
    assert not s.has_pending_push_work()


def test_d_key_defaults_to_base_of_own_request_id() -> None:
    s = sched()
    req = make_request("cmpl-abc-0-0123abcd", 10, P_IDENTITY)
    s.update_state_after_alloc(req, blocks([], [1]), 10)
    assert s.build_connector_meta().registrations[0].transfer_key == "r:cmpl-abc-0"
    assert base_request_id("cmpl-abc-0-0123ABCD") == "cmpl-abc-0"
    assert base_request_id("no-suffix") == "no-suffix"


def test_d_without_p_identity_prefills_locally() -> None:
    s = sched()
    params = {k: v for k, v in P_IDENTITY.items() if k != "remote_host"}
    req = make_request("r-1", 50, params)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.get_num_new_matched_tokens(make_request("r-2", 50, None), 0) == (0, False)


def test_d_registers_with_a_pipeline_parallel_p_naming_both_sizes() -> None:
    """P's answer carries ``pp_size``; D's workers register with every stage of P."""
    s = sched()
    req = make_request("cmpl-pp-0-0123abcd", 200, P_IDENTITY | {"tp_size": 2, "pp_size": 2})
    assert s.get_num_new_matched_tokens(req, 0) == (200, True)
    s.update_state_after_alloc(req, blocks([], [4, 5]), 200)
    [spec] = s.build_connector_meta().registrations
    assert (spec.port, spec.p_tp_size, spec.p_pp_size) == (18250, 2, 2)
    s.request_finished(make_request("r-pp-2", 50, P_IDENTITY | {"pp_size": 2}), [])
    [cancel] = s.build_connector_meta().key_cancels
    assert (cancel.p_tp_size, cancel.p_pp_size) == (1, 2)


def test_d_registers_with_a_tensor_parallel_p_naming_its_size() -> None:
    s = sched()
    req = make_request("cmpl-t-0-0123abcd", 200, P_IDENTITY | {"tp_size": 2})
    assert s.get_num_new_matched_tokens(req, 0) == (200, True)
    s.update_state_after_alloc(req, blocks([], [4, 5]), 200)
    [spec] = s.build_connector_meta().registrations
    assert (spec.port, spec.p_tp_size) == (18250, 2)  # D's ranks add P's rank to the port


def test_d_full_local_hit_releases_p_at_once() -> None:
    s = sched()
    req = make_request("cmpl-z-0-0123abcd", 256, P_IDENTITY | {"transfer_id": "z"})
    assert s.get_num_new_matched_tokens(req, 256) == (0, False)
    s.update_state_after_alloc(req, blocks([1, 2], []), 0)
    meta = s.build_connector_meta()
    assert meta.registrations == []
    assert meta.key_cancels == [KeyCancel("t:z", "127.0.0.1", 18250)]


def test_d_abort_while_waiting_asks_worker_to_cancel() -> None:
    s = sched()
    req = make_request("cmpl-a-0-0123abcd", 200, P_IDENTITY)
    s.update_state_after_alloc(req, blocks([], [4, 5]), 200)
    s.build_connector_meta()
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req, [4, 5]) == (False, None)  # vLLM holds the blocks itself
    assert s.build_connector_meta().cancels == ["cmpl-a-0-0123abcd"]


def test_d_finished_after_receive_needs_no_cancel() -> None:
    s = sched()
    req = make_request("cmpl-b-0-0123abcd", 200, P_IDENTITY)
    s.update_state_after_alloc(req, blocks([], [4, 5]), 200)
    s.build_connector_meta()
    s.update_connector_output(None, {"cmpl-b-0-0123abcd"})
    req.status = RequestStatus.FINISHED_STOPPED
    assert s.request_finished(req, [4, 5]) == (False, None)
    meta = s.build_connector_meta()
    assert meta.cancels == [] and meta.key_cancels == []


def test_d_abort_before_allocation_releases_p() -> None:
    s = sched()
    req = make_request("cmpl-c-0-0123abcd", 200, P_IDENTITY | {"transfer_id": "c"})
    req.status = RequestStatus.FINISHED_ABORTED
    s.request_finished(req, [])
    assert s.build_connector_meta().key_cancels == [KeyCancel("t:c", "127.0.0.1", 18250)]


def test_p_keeps_blocks_and_returns_its_identity() -> None:
    s = PushScheduler("p0", "127.0.0.1", 18250, 128)
    req = make_request("cmpl-q-0-0123abcd", 300, {"do_remote_decode": True, "transfer_id": "q"})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(req, [1, 2, 3])
    assert delay is True and params is not None
    assert params["remote_engine_id"] == "p0" and params["remote_port"] == 18250
    assert params["remote_request_id"] == "cmpl-q-0-0123abcd" and params["transfer_id"] == "q"
    assert params["do_remote_prefill"] is True
    assert s.has_pending_push_work()
    assert s.build_connector_meta().finished_prefills == [
        SendSpec("cmpl-q-0-0123abcd", "t:q", (1, 2, 3))
    ]
    assert s.has_pending_push_work()  # until the worker reports the blocks sent
    s.update_connector_output({"cmpl-q-0-0123abcd"}, None)
    assert not s.has_pending_push_work()


def test_identity_probe_answers_identity_and_keeps_no_blocks() -> None:
    s = PushScheduler("p0", "127.0.0.1", 18250, 128)
    req = make_request(
        "cmpl-i-0-0123abcd",
        1,
        {"do_remote_decode": True, "transfer_id": "i", "identity_probe": True},
    )
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(req, [7])
    assert delay is False and params is not None  # vLLM frees the block now
    assert params["remote_engine_id"] == "p0" and params["remote_port"] == 18250
    assert params["remote_block_ids"] == []
    assert s.build_connector_meta().finished_prefills == []  # no lease, nothing to send
    assert not s.has_pending_push_work()


def test_identity_probe_answer_carries_ps_shape() -> None:
    shape = EngineShape(tp_size=2, pp_size=1, block_size=16, num_kv_heads=8)
    s = PushScheduler("p0", "127.0.0.1", 18250, 16, shape=shape)
    req = make_request("cmpl-i-0-0123abcd", 1, prefill_leg_params("i", probe=True))
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = s.request_finished(req, [7])
    assert read_engine_shape(params) == shape
    assert read_prefill_answer(params or {}).peer.tp_size == 2
    # Without a configured shape: TP=PP=1 and the engine's block size.
    _, default = PushScheduler("p0", "127.0.0.1", 18250, 128).request_finished(req, [7])
    assert read_engine_shape(default) == EngineShape(1, 1, 128)


def test_a_pipeline_parallel_ps_answer_names_its_pp_size_for_d() -> None:
    shape = EngineShape(tp_size=1, pp_size=2, block_size=16, num_kv_heads=8)
    s = PushScheduler("p0", "127.0.0.1", 18250, 16, shape=shape)
    req = make_request("cmpl-pp-0-0123abcd", 1, prefill_leg_params("pp"))
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = s.request_finished(req, [7])
    assert read_prefill_answer(params or {}).peer.pp_size == 2


def test_d_answers_a_bare_identity_probe_with_its_shape_and_keeps_nothing() -> None:
    shape = EngineShape(tp_size=1, pp_size=1, block_size=16, num_kv_heads=8)
    s = PushScheduler("d0", "127.0.0.1", 18251, 16, shape=shape)
    req = make_request("cmpl-d-0-0123abcd", 4, identity_probe_params())
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # D prefills it locally
    s.update_state_after_alloc(req, blocks([], [1]), 0)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(req, [1])
    assert delay is False and read_engine_shape(params) == shape
    meta = s.build_connector_meta()
    assert meta.registrations == [] and meta.key_cancels == [] and meta.failed_prefills == []
    assert not s.has_pending_push_work()
    # A request without the probe key still gets no params (nothing else changed).
    assert s.request_finished(make_request("r-2", 4, None), [1]) == (False, None)


def test_probe_key_is_the_one_the_router_sends() -> None:
    from disagg_router.connector.contract import IDENTITY_PROBE_KEY
    from disagg_router.router.upstream.rewrite import prefill_body

    body = prefill_body({"model": "m", "prompt": "ping"}, chat=False, transfer_id="x", probe=True)
    assert body["kv_transfer_params"][IDENTITY_PROBE_KEY] is True
    plain = prefill_body({"model": "m", "prompt": "hi"}, chat=False, transfer_id="y")
    assert IDENTITY_PROBE_KEY not in plain["kv_transfer_params"]


def test_p_abort_tells_d_and_frees_at_once() -> None:
    s = PushScheduler("p0", "127.0.0.1", 18250, 128)
    req = make_request("cmpl-r-0-0123abcd", 300, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req, [1, 2, 3]) == (False, None)
    meta = s.build_connector_meta()
    assert meta.failed_prefills == [
        SendAbort("r:cmpl-r-0", "prefill ended with status FINISHED_ABORTED")
    ]
    assert meta.finished_prefills == []


def test_plain_request_is_untouched() -> None:
    s = sched()
    req = make_request("plain", 10, None)
    req.status = RequestStatus.FINISHED_STOPPED
    assert s.request_finished(req, [1]) == (False, None)
    assert not s.has_pending_push_work()


def test_scheduler_and_router_speak_the_same_contract() -> None:
    """The router's leg bodies read as the scheduler expects, and P's answer reads back with the
    contract's reader and the router's ``identity_from_kv``."""
    from disagg_router.connector.contract import PeerIdentity, PrefillAnswer, read_prefill_answer
    from disagg_router.router.config import PushIdentity
    from disagg_router.router.upstream.rewrite import (
        decode_body_push,
        identity_from_kv,
        prefill_body,
    )

    p = PushScheduler("p0", "127.0.0.1", 18250, 128)
    p_body = prefill_body({"model": "m", "prompt": "x"}, False, "tid")
    req = make_request("cmpl-tid-0-0123abcd", 300, p_body["kv_transfer_params"])
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = 300
    _, answer = p.request_finished(req, [1, 2, 3])
    assert answer is not None
    peer = PeerIdentity("p0", "127.0.0.1", 18250)
    assert read_prefill_answer(answer) == PrefillAnswer(
        peer, "cmpl-tid-0-0123abcd", (1, 2, 3), 300, "push", "tid"
    )
    identity = identity_from_kv(answer)
    assert identity == PushIdentity(engine_id="p0", host="127.0.0.1", port=18250)

    d = sched()
    d_body = decode_body_push({"model": "m", "prompt": "x"}, identity, "cmpl-tid-0-0123abcd", "tid")
    d_req = make_request("cmpl-tid-0-fedcba98", 300, d_body["kv_transfer_params"])
    assert d.get_num_new_matched_tokens(d_req, 0) == (300, True)
    d.update_state_after_alloc(d_req, blocks([], [5, 6]), 300)
    assert d.build_connector_meta().registrations == [
        RecvSpec("cmpl-tid-0-fedcba98", "t:tid", "p0", "127.0.0.1", 18250, (5, 6), 0)
    ]


def test_engine_shape_reads_vllms_config() -> None:
    from types import SimpleNamespace

    from disagg_router.connector.scheduler import engine_shape

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 8),
    )
    assert engine_shape(config) == EngineShape(2, 1, 16, num_kv_heads=8)


def test_a_tensor_parallel_p_answers_its_tp_size() -> None:
    s = PushScheduler("p0", "127.0.0.1", 18250, 128, tp_size=2)
    req = make_request("cmpl-v-0-0123abcd", 300, {"do_remote_decode": True, "transfer_id": "v"})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = s.request_finished(req, [1, 2, 3])
    assert params is not None
    answer = read_prefill_answer(params)
    assert (answer.peer.tp_size, answer.peer.port) == (2, 18250)  # rank r listens on port + r
