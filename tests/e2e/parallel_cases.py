"""The connector's cases for parallel shapes, written once for every stack that runs them.

Who calls it: ``test_connector_parallel_e2e.py`` (P and D at TP 1 and 2, P at PP 2) and
``test_connector_mla_parallel_e2e.py`` (the same on an MLA model). Each case takes a stack, a P
and a D instance and a tag that keeps its prompts apart from every other case's (so D's prefix
cache never holds them). The two-leg client is the one of ``test_connector_e2e.py`` (both
legs at once, same ``X-Request-Id`` and ``transfer_id``, the D leg naming P's ``tp_size`` and
``pp_size``), so the cases depend on the connector only. References are plain requests (no
``kv_transfer_params``) to the P instance named in :data:`REFERENCE` for D's TP size: an
aggregated request of that shape; greedy tokens are compared with the suite's near-tie rule.
Run under ``flock /tmp/vllm-e2e.lock``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devstack.stack import Stack, StackInstance
from disagg_router.connector.contract import (
    decode_leg_params,
    prefill_leg_params,
    read_prefill_answer,
)
from tests.e2e.e2e_support import (
    MAX_TOKENS,
    Greedy,
    assert_greedy_close,
    load,
    metrics,
)
from tests.e2e.test_connector_e2e import (
    abort_p_leg_before_prefill_ends,
    assert_failed_by_p_abort,
    tokens,
    wait_registered,
)
from tests.support.wait import wait_until

TOP = 5
TIMEOUT = httpx.Timeout(180.0, connect=10.0)
# Bounds sized for a loaded 2-core machine running six workers (a starved worker can take many
# seconds to finish a WRITE); the failure cases end by P's and D's own signals, not these.
EXTRA = {"transfer_timeout_s": 90.0, "max_inflight_s": 60.0, "lease_s": 120.0}
REFERENCE = {1: "p0", 2: "p1"}
"""The P instance whose plain requests are the aggregated reference for a D of each TP size
(``p0`` is a TP 1, PP 1 instance in every stack that runs these cases)."""


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


async def greedy_case(stack: Stack, p: StackInstance, d: StackInstance, tag: str) -> None:
    """Two prompts through P and D: D's greedy output equals an aggregated request to the P
    instance of D's shape (``reference``), P's answer names its shape, and D computed (almost)
    none of the prompt (its ``external_kv_transfer`` prompt tokens)."""
    reference = named(stack, REFERENCE[d.tp_size])
    prompts = [tokens(f"{tag}-{n}", n) for n in (300, 2 * 128 + 5)]
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        for prompt in prompts:
            plain = await client.post(
                reference.url + "/v1/completions", json=body(prompt, MAX_TOKENS, None)
            )
            assert plain.status_code == 200, plain.text
            before = external_tokens(d)
            p_json, got = await legs(client, p, d, prompt, uuid.uuid4().hex)
            peer = read_prefill_answer(p_json["kv_transfer_params"]).peer
            assert (peer.tp_size, peer.pp_size) == (p.tp_size, p.pp_size)
            assert_greedy_close(greedy(got), greedy(plain.json()), f"{tag} {len(prompt)} tokens")
            assert got["usage"]["prompt_tokens"] == len(prompt)
            pulled = external_tokens(d) - before
            assert len(prompt) - 1 <= pulled <= len(prompt), (pulled, len(prompt))
    await asyncio.to_thread(wait_all_kv_free, stack)


async def p_abort_case(stack: Stack, p: StackInstance, d: StackInstance, tag: str) -> None:
    """P's client goes away before P's prefill ends: every P rank tells the D ranks it feeds,
    which fail the request with P's reason; every instance frees every block."""
    rid = uuid.uuid4().hex
    prompt = tokens(f"{tag}-p-abort", 16000)
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
        await abort_p_leg_before_prefill_ends(client, p, p_body, rid)
        resp_d = await d_leg
    assert resp_d.status_code >= 400
    await assert_failed_by_p_abort(stack, d, rid)
    await asyncio.to_thread(wait_all_kv_free, stack)


async def d_abort_case(stack: Stack, p: StackInstance, d: StackInstance, tag: str) -> None:
    """D waits on every P rank (no P leg) and its client goes away: each D rank cancels its
    registrations and every block of every instance is freed."""
    rid = uuid.uuid4().hex
    stream_body = body(tokens(f"{tag}-d-abort", 4 * 128), MAX_TOKENS, d_params(p, rid))
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


async def disconnect_case(stack: Stack, p: StackInstance, d: StackInstance, tag: str) -> None:
    """The client reads D's first tokens and goes away; every rank of both sides frees."""
    rid = uuid.uuid4().hex
    prompt = tokens(f"{tag}-disconnect", 3 * 128 + 7)
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


Case = Callable[[Stack, StackInstance, StackInstance, str], Awaitable[None]]
CASES: dict[str, Case] = {
    "greedy_equal_and_no_recompute": greedy_case,
    "p_abort_frees_every_rank": p_abort_case,
    "d_abort_frees_every_rank": d_abort_case,
    "client_disconnect_frees_every_rank": disconnect_case,
}
"""Every case, by the name its test id carries."""
