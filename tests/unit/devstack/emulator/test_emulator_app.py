"""The HTTP face of emulated engines (``devstack.emulator.app``), served by a real 1P1D
:class:`devstack.emulator.Fleet`: vLLM's routes and refusals, identity probes, a P leg's answer
as the router's connector contract reads it, a streamed chat with usage, a D leg sent before its
P leg (push order) that decodes from P's KV (and our connector's hand-over figures saying so),
and vLLM's metric names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devstack.emulator import Fleet, FleetSpec, load_profile
from disagg_router.connector.contract import (
    KV_TRANSFER_PARAMS,
    PrefillAnswer,
    decode_leg_params,
    prefill_leg_params,
    read_prefill_answer,
)
from disagg_router.router.instances.load import parse_signals
from tests.support.wait import wait_until

MAX_LEN = 512
BLOCK = 128
PROMPT = list(range(1, 301))  # two full blocks and a partial one
TIMEOUT = 10.0
D_BLOCKS = 32  # D's KV cache cut below the profile's 64 blocks


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    profile = replace(load_profile("cpu-tiny"), max_model_len=MAX_LEN, num_blocks=64)
    spec = FleetSpec(profile, 1, 1, kv_events=False, decode_num_blocks=D_BLOCKS)
    with Fleet(spec) as running:
        yield running


@pytest.fixture(scope="module")
def p_url(fleet: Fleet) -> str:
    url: str = fleet.instances("prefill")[0]["url"]
    return url


@pytest.fixture(scope="module")
def d_url(fleet: Fleet) -> str:
    url: str = fleet.instances("decode")[0]["url"]
    return url


def _blocks_in_use(fleet: Fleet) -> list[int]:
    return fleet.call(
        lambda: [m.engine.pool.num_blocks - m.engine.pool.free_blocks for m in fleet.members]
    )


def _post(url: str, body: dict[str, Any], chat: bool = False) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)


def _p_leg(p_url: str, transfer_id: str) -> PrefillAnswer:
    body = {"model": "tiny", "prompt": PROMPT, KV_TRANSFER_PARAMS: prefill_leg_params(transfer_id)}
    response = _post(p_url, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1
    return read_prefill_answer(response.json()[KV_TRANSFER_PARAMS])


def _d_leg(answer: PrefillAnswer, transfer_id: str, max_tokens: int) -> dict[str, Any]:
    peer = answer.peer
    params = decode_leg_params(
        engine_id=peer.engine_id,
        host=peer.host,
        port=peer.port,
        tp_size=peer.tp_size,
        pp_size=peer.pp_size,
        request_id=answer.request_id or f"cmpl-{transfer_id}-0",
        transfer_id=transfer_id,
    )
    return {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        KV_TRANSFER_PARAMS: params,
    }


def _probe(p_url: str) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        KV_TRANSFER_PARAMS: prefill_leg_params("t", probe=True),
    }
    response = _post(p_url, body)
    assert response.status_code == 200, response.text
    kv: dict[str, Any] = response.json()[KV_TRANSFER_PARAMS]
    return kv


def _sse_payloads(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def test_d_engines_have_the_kv_cache_they_were_cut_to(fleet: Fleet) -> None:
    sizes = fleet.call(lambda: {m.role: m.engine.pool.num_blocks for m in fleet.members})
    assert sizes == {"prefill": 64, "decode": D_BLOCKS}


def test_models_lists_the_profiles_model(p_url: str) -> None:
    response = httpx.get(f"{p_url}/v1/models", timeout=TIMEOUT)
    assert response.status_code == 200
    (card,) = response.json()["data"]
    assert card["id"] == "tiny" and card["max_model_len"] == MAX_LEN


def test_health_answers_200(p_url: str, d_url: str) -> None:
    for url in (p_url, d_url):
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200


@pytest.mark.parametrize("value", [0, -3, "4", True, 1.5])
def test_a_bad_max_tokens_is_a_400_naming_it(d_url: str, value: object) -> None:
    response = _post(d_url, {"model": "tiny", "prompt": "hi", "max_tokens": value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_an_unknown_model_is_a_404(d_url: str) -> None:
    response = _post(d_url, {"model": "other", "prompt": "hi"})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


def test_a_prompt_too_long_for_the_model_is_a_400_naming_it(d_url: str) -> None:
    too_long = list(range(1, MAX_LEN - 4))  # fits alone, not with 16 tokens to generate
    response = _post(d_url, {"model": "tiny", "prompt": too_long, "max_tokens": 16})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert _post(d_url, {"prompt": too_long, "max_tokens": 1}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "x" * 4 * MAX_LEN}]}
    response = _post(d_url, chat, chat=True)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"


def test_an_identity_probe_answers_with_ps_identity_and_holds_nothing(
    fleet: Fleet, p_url: str
) -> None:
    before = _blocks_in_use(fleet)
    steps = fleet.call(lambda: fleet.members[0].engine.counters.steps)
    answer = read_prefill_answer(_probe(p_url))
    assert answer.peer.engine_id == "emulated-p0"
    assert (answer.peer.host, answer.peer.port) == ("127.0.0.1", urlsplit(p_url).port)
    assert answer.block_ids == ()
    assert _blocks_in_use(fleet) == before
    assert fleet.call(lambda: fleet.members[0].engine.counters.steps) == steps  # no work


def test_an_identity_probe_leaves_nothing_in_the_fabric(fleet: Fleet, p_url: str) -> None:
    before = fleet.call(lambda: len(fleet.fabric._keys))
    _probe(p_url)
    assert fleet.call(lambda: len(fleet.fabric._keys)) == before


def test_a_prefill_answer_is_read_by_the_contract_and_its_kv_goes_to_d(
    fleet: Fleet, p_url: str, d_url: str
) -> None:
    transfers = fleet.call(lambda: fleet.fabric.transfers)
    p_before = _handover_figures(p_url)
    answer = _p_leg(p_url, "pull-1")
    assert answer.num_tokens == len(PROMPT)
    assert answer.block_ids is not None and len(answer.block_ids) == 3
    assert answer.transfer_id == "pull-1" and answer.transfer_mode == "push"
    assert answer.peer.engine_id == "emulated-p0"
    # pull order: P holds its blocks until D takes them
    response = _post(d_url, _d_leg(answer, "pull-1", max_tokens=2))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 2
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
    assert fleet.call(lambda: fleet.fabric.transfers) == transfers + 1
    wait_until(lambda: not any(_blocks_in_use(fleet)), what="P's and D's blocks free")
    p_after = _handover_figures(p_url)
    # P finished before D registered: its prefill's wait was not 0
    assert p_after["waits"] == p_before["waits"] + 1
    assert p_after["waited_0"] == p_before["waited_0"]
    assert p_after["wait_sum"] > p_before["wait_sum"]


def _handover_figures(url: str) -> dict[str, float]:
    """Our connector's hand-over figures on an instance's ``/metrics``: transfers, D's
    unwritten block-seconds, P's waits for D's registration (all, and those of 0 s)."""
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    values = {
        (sample.name, sample.labels.get("le")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    wait = "disagg_push_wait_for_registration_seconds"
    return {
        "transfers": values[("disagg_push_transfers_total", None)],
        "unwritten": values[("disagg_push_unwritten_block_seconds_total", None)],
        "waits": values[(f"{wait}_count", None)],
        "waited_0": values[(f"{wait}_bucket", "0.0")],
        "wait_sum": values[(f"{wait}_sum", None)],
    }


def test_a_streamed_chat_ends_with_usage_then_done(d_url: str) -> None:
    messages = [{"role": "user", "content": "hello there, emulated engine"}]
    prompt_tokens = httpx.post(
        f"{d_url}/tokenize", json={"messages": messages}, timeout=TIMEOUT
    ).json()["count"]
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = _post(d_url, body, chat=True)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = _sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert len(tokens) == 3
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, "length"]
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["prompt_tokens"] == prompt_tokens


def test_a_decode_leg_sent_before_its_prefill_leg_decodes_from_ps_kv(
    fleet: Fleet, p_url: str, d_url: str
) -> None:
    identity = read_prefill_answer(_probe(p_url))
    transfers = fleet.call(lambda: fleet.fabric.transfers)
    d_engine = fleet.call(lambda: fleet.members[1].engine)
    p_before, d_before = _handover_figures(p_url), _handover_figures(d_url)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(_post, d_url, _d_leg(identity, "push-1", max_tokens=3))
        wait_until(
            lambda: fleet.call(lambda: len(d_engine.scheduler.awaiting_kv)) == 1,
            what="the D leg waiting for P's KV",
        )
        assert not pending.done()
        answer = _p_leg(p_url, "push-1")
        assert answer.transfer_id == "push-1"
        response = pending.result(timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == " tok0 tok1 tok2"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 3
    assert fleet.call(lambda: fleet.fabric.transfers) == transfers + 1
    wait_until(lambda: not any(_blocks_in_use(fleet)), what="P's and D's blocks free")
    p_after, d_after = _handover_figures(p_url), _handover_figures(d_url)
    assert p_after["transfers"] == p_before["transfers"] + 1
    assert d_after["transfers"] == d_before["transfers"] + 1
    # D registered first: P's prefill waited 0 s, D's blocks waited through it
    assert p_after["waits"] == p_before["waits"] + 1
    assert p_after["waited_0"] == p_before["waited_0"] + 1
    assert d_after["unwritten"] > d_before["unwritten"]
    assert p_after["unwritten"] == p_before["unwritten"]  # P's blocks are not D's


def test_metrics_use_vllms_names(p_url: str) -> None:
    response = httpx.get(f"{p_url}/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert f'{name}{{model_name="tiny"}} ' in response.text
    # the router reads the KV cache's size from vLLM's cache config gauge: 64 blocks of the
    # profile's size
    signals = parse_signals(response.text, "tiny", 0.0)
    assert signals is not None
    assert signals.kv_tokens == 64 * load_profile("cpu-tiny").block_size
