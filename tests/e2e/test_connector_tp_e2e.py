"""The connector with tensor parallelism, end to end: real vLLM CPU, P and D at TP 1 and TP 2.

One stack of four instances serves every combination: ``p0`` (P, TP 1), ``p1`` (P, TP 2), ``d0``
(D, TP 1), ``d1`` (D, TP 2); a TP 2 instance runs two workers (multiprocess executor), both on
its instance's core, so P's and D's workers never share a core. The tiny model has 2 KV heads,
so a TP 2 rank holds one: P TP 2 -> D TP 1 writes each P rank's head at its offset of D's
blocks (D waits for both ranks), P TP 1 -> D TP 2 writes each D rank its head, TP 2 -> TP 2
goes rank to rank. Every case runs the greedy check and the three failures (P abort, D abort,
client disconnect). The two-leg client is the one of ``test_connector_e2e.py`` (both legs at
once, same ``X-Request-Id`` and ``transfer_id``), so this depends on the connector only.

References: a plain request (no ``kv_transfer_params``) to the P instance of D's TP size
(``p0`` or ``p1``) is an aggregated request at that TP size; references never come from D, so
D's prefix cache holds only what came through the connector. Greedy tokens are compared with the
suite's near-tie rule (``e2e_support.assert_greedy_close``). Run under ``flock /tmp/vllm-e2e.lock``.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from connector.contract import decode_leg_params, prefill_leg_params, read_prefill_answer
from devstack.stack import Stack, StackInstance, StackOptions
from tests.e2e.e2e_support import (
    MAX_TOKENS,
    Greedy,
    assert_greedy_close,
    load,
    metrics,
    module_stack,
)
from tests.e2e.test_connector_e2e import tokens, wait_failure_reason, wait_registered
from tests.support.wait import wait_until

pytestmark = [pytest.mark.vllm]

TOP = 5
TIMEOUT = httpx.Timeout(180.0, connect=10.0)
# Bounds sized for a loaded 2-core machine running six workers (a starved worker can take many
# seconds to finish a WRITE); the failure tests below end by P's and D's own signals, not these.
EXTRA = {"transfer_timeout_s": 90.0, "max_inflight_s": 60.0, "lease_s": 120.0}
CASES = [("p1", "d0"), ("p0", "d1"), ("p1", "d1")]
REFERENCE = {1: "p0", 2: "p1"}  # the P instance serving aggregated requests at each TP size


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    options = StackOptions(
        kind="ours",
        topology="2p2d",
        tensor_parallel={"p1": 2, "d1": 2},
        connector_extra_config=EXTRA,
    )
    with module_stack(options, e2e_dir) as s:
        yield s


def named(stack: Stack, name: str) -> StackInstance:
    return next(i for i in stack.instances if i.name == name)


def body(prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": TOP,
        "ignore_eos": True,  # always MAX_TOKENS tokens to compare
    }
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def d_params(p: StackInstance, rid: str) -> dict[str, Any]:
    """The D leg's params, P's identity with P's tensor- and pipeline-parallel sizes (as the
    router sends)."""
    assert p.engine_id is not None and p.side_channel_port is not None
    return decode_leg_params(
        engine_id=p.engine_id,
        host="127.0.0.1",
        port=p.side_channel_port,
        tp_size=p.tp_size,
        pp_size=p.pp_size,
        request_id=f"cmpl-{rid}-0",
        transfer_id=rid,
    )


async def legs(
    client: httpx.AsyncClient, p: StackInstance, d: StackInstance, prompt: list[int], rid: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both legs at once; P's and D's JSON (each must answer 200)."""
    headers = {"X-Request-Id": rid}
    p_leg = client.post(
        p.url + "/v1/completions", headers=headers, json=body(prompt, 1, prefill_leg_params(rid))
    )
    d_leg = client.post(
        d.url + "/v1/completions", headers=headers, json=body(prompt, MAX_TOKENS, d_params(p, rid))
    )
    p_resp, d_resp = await asyncio.gather(p_leg, d_leg)
    assert p_resp.status_code == 200, p_resp.text
    assert d_resp.status_code == 200, d_resp.text
    return p_resp.json(), d_resp.json()


def greedy(answer: dict[str, Any]) -> Greedy:
    lp = answer["choices"][0]["logprobs"]
    return Greedy(list(lp["tokens"]), [dict(t) for t in lp["top_logprobs"]])


def external_tokens(d: StackInstance) -> float:
    """D's prompt tokens that came from the KV connector (``vllm:prompt_tokens_by_source``)."""
    response = httpx.get(d.url + "/metrics", timeout=httpx.Timeout(10.0))
    response.raise_for_status()
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        if family.name == "vllm:prompt_tokens_by_source"
        for sample in family.samples
        if sample.labels.get("source") == "external_kv_transfer" and sample.name.endswith("_total")
    )


def free(inst: StackInstance) -> bool:
    """Idle, with KV usage 0 (every block of every rank freed)."""
    return load(inst) == (0.0, 0.0) and metrics(inst).get("vllm:kv_cache_usage_perc") == 0.0


def wait_all_kv_free(stack: Stack) -> None:
    """Every instance idle with KV usage back to 0."""
    for inst in stack.instances:
        wait_until(partial(free, inst), 60.0, f"{inst.name} idle with KV usage 0", 0.25)


@pytest.mark.parametrize(("p_name", "d_name"), CASES)
async def test_greedy_equal_to_aggregated_of_ds_tp_and_no_recompute(
    stack: Stack, p_name: str, d_name: str
) -> None:
    p, d = named(stack, p_name), named(stack, d_name)
    reference_p = named(stack, REFERENCE[d.tp_size])  # aggregated at D's TP size
    prompts = [tokens(f"tp-{p_name}-{d_name}-{n}", n) for n in (300, 2 * 128 + 5)]
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        for prompt in prompts:
            plain = await client.post(
                reference_p.url + "/v1/completions", json=body(prompt, MAX_TOKENS, None)
            )
            assert plain.status_code == 200, plain.text
            ref = greedy(plain.json())
            before = external_tokens(d)
            rid = uuid.uuid4().hex
            p_json, got = await legs(client, p, d, prompt, rid)
            assert read_prefill_answer(p_json["kv_transfer_params"]).peer.tp_size == p.tp_size
            assert_greedy_close(greedy(got), ref, f"{p_name}->{d_name} {len(prompt)} tokens")
            assert got["usage"]["prompt_tokens"] == len(prompt)
            # The prompt's KV came through the connector: D computed (almost) none of it.
            pulled = external_tokens(d) - before
            assert len(prompt) - 1 <= pulled <= len(prompt), (pulled, len(prompt))
    wait_all_kv_free(stack)


@pytest.mark.parametrize(("p_name", "d_name"), CASES)
async def test_p_abort_fails_a_tp_d_fast_and_frees_every_rank(
    stack: Stack, p_name: str, d_name: str
) -> None:
    """P aborts mid-prefill: every P rank tells the D ranks it feeds, which fail the request."""
    p, d = named(stack, p_name), named(stack, d_name)
    rid = uuid.uuid4().hex
    prompt = tokens(f"tp-p-abort-{p_name}-{d_name}", 16000)
    headers = {"X-Request-Id": rid}
    p_body = body(prompt, 1, prefill_leg_params(rid)) | {"stream": True}
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        d_leg = asyncio.ensure_future(
            client.post(
                d.url + "/v1/completions",
                headers=headers,
                json=body(prompt, MAX_TOKENS, d_params(p, rid)),
            )
        )
        await wait_registered(d)
        p_leg = asyncio.ensure_future(
            client.post(p.url + "/v1/completions", json=p_body, headers=headers)
        )
        await asyncio.to_thread(
            wait_until, lambda: load(p)[0] >= 1, 60.0, "P to start the prefill", 0.01
        )
        p_leg.cancel()
        with pytest.raises(asyncio.CancelledError):
            await p_leg
        resp_d = await d_leg
    assert resp_d.status_code >= 400
    reason = await wait_failure_reason(d, rid)
    assert re.search(r"P (failed|refused): prefill ended with status FINISHED_ABORTED", reason)
    await asyncio.to_thread(wait_all_kv_free, stack)


@pytest.mark.parametrize(("p_name", "d_name"), CASES)
async def test_d_abort_while_waiting_frees_every_rank(
    stack: Stack, p_name: str, d_name: str
) -> None:
    """D waits on every P rank (no P leg) and its client goes away: each D rank cancels its
    registrations and every block of every instance is freed."""
    p, d = named(stack, p_name), named(stack, d_name)
    rid = uuid.uuid4().hex
    prompt = tokens(f"tp-d-abort-{p_name}-{d_name}", 4 * 128)
    stream_body = body(prompt, MAX_TOKENS, d_params(p, rid))
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream(
                "POST",
                d.url + "/v1/completions",
                json=stream_body | {"stream": True},
                headers={"X-Request-Id": rid},
                timeout=httpx.Timeout(3.0, connect=10.0),
            ) as resp:
                async for _ in resp.aiter_bytes():
                    pass
    await asyncio.to_thread(wait_all_kv_free, stack)


@pytest.mark.parametrize(("p_name", "d_name"), CASES)
async def test_client_disconnect_mid_decode_frees_every_rank(
    stack: Stack, p_name: str, d_name: str
) -> None:
    """The client reads D's first tokens and goes away; every rank of both sides frees."""
    p, d = named(stack, p_name), named(stack, d_name)
    rid = uuid.uuid4().hex
    prompt = tokens(f"tp-disconnect-{p_name}-{d_name}", 3 * 128 + 7)
    headers = {"X-Request-Id": rid}
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        p_leg = asyncio.ensure_future(
            client.post(
                p.url + "/v1/completions",
                headers=headers,
                json=body(prompt, 1, prefill_leg_params(rid)),
            )
        )
        d_body = body(prompt, 2000, d_params(p, rid)) | {"stream": True}
        async with client.stream(
            "POST", d.url + "/v1/completions", json=d_body, headers=headers
        ) as resp:
            assert resp.status_code == 200
            async for chunk in resp.aiter_bytes():
                if b'"text"' in chunk:
                    break  # the first token arrived: the KV landed; now go away
        assert (await p_leg).status_code == 200
    await asyncio.to_thread(wait_all_kv_free, stack)
