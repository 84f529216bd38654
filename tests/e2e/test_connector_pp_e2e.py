"""The connector with a pipeline-parallel P, end to end: real vLLM CPU, P PP 2 -> D TP 1.

One stack of three instances: ``p0`` (P, PP 1: the aggregated reference), ``p1`` (P, PP 2: two
workers, one per pipeline stage, both on P's core, each holding one of the tiny model's two
layers) and ``d0`` (D, TP 1). Each stage of ``p1`` listens on its own side channel (the base
port + its vLLM rank) and writes its layer into D's region of that layer; D registers with both
stages and decodes once both ``done`` notifications arrived. The checks are those of
``test_connector_tp_e2e.py`` (its two-leg client, D leg naming P's ``pp_size``): greedy output
equal to an aggregated request, D's ``external_kv_transfer`` prompt tokens about the prompt,
and KV usage back to 0 on every instance after a P abort, a D abort and a client disconnect.
Run under ``flock /tmp/vllm-e2e.lock``.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from connector.contract import prefill_leg_params, read_prefill_answer
from devstack.stack import Stack, StackOptions
from tests.e2e.e2e_support import MAX_TOKENS, assert_greedy_close, load, module_stack
from tests.e2e.test_connector_e2e import tokens, wait_failure_reason, wait_registered
from tests.e2e.test_connector_tp_e2e import (
    EXTRA,
    TIMEOUT,
    body,
    d_params,
    external_tokens,
    greedy,
    legs,
    named,
    wait_all_kv_free,
)
from tests.support.wait import wait_until

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    options = StackOptions(
        kind="ours",
        topology="2p1d",
        pipeline_parallel={"p1": 2},
        connector_extra_config=EXTRA,
    )
    with module_stack(options, e2e_dir) as s:
        yield s


async def test_greedy_equal_to_aggregated_and_no_recompute(stack: Stack) -> None:
    p, d, reference = named(stack, "p1"), named(stack, "d0"), named(stack, "p0")
    prompts = [tokens(f"pp-{n}", n) for n in (300, 2 * 128 + 5)]
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        for prompt in prompts:
            plain = await client.post(
                reference.url + "/v1/completions", json=body(prompt, MAX_TOKENS, None)
            )
            assert plain.status_code == 200, plain.text
            before = external_tokens(d)
            p_json, got = await legs(client, p, d, prompt, uuid.uuid4().hex)
            assert read_prefill_answer(p_json["kv_transfer_params"]).peer.pp_size == 2
            assert_greedy_close(greedy(got), greedy(plain.json()), f"PP 2 -> TP 1 {len(prompt)}")
            assert got["usage"]["prompt_tokens"] == len(prompt)
            # The prompt's KV came through the connector, both layers: D computed none of it.
            pulled = external_tokens(d) - before
            assert len(prompt) - 1 <= pulled <= len(prompt), (pulled, len(prompt))
    wait_all_kv_free(stack)


async def test_p_abort_fails_d_fast_and_frees_every_stage(stack: Stack) -> None:
    """P aborts mid-prefill: each stage tells D, which fails the request."""
    p, d = named(stack, "p1"), named(stack, "d0")
    rid = uuid.uuid4().hex
    prompt = tokens("pp-p-abort", 16000)
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


async def test_d_abort_while_waiting_frees_every_stage(stack: Stack) -> None:
    """D waits on both stages (no P leg) and its client goes away: D cancels both legs."""
    p, d = named(stack, "p1"), named(stack, "d0")
    rid = uuid.uuid4().hex
    stream_body = body(tokens("pp-d-abort", 4 * 128), MAX_TOKENS, d_params(p, rid))
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


async def test_client_disconnect_mid_decode_frees_every_stage(stack: Stack) -> None:
    """The client reads D's first tokens and goes away; both sides free every block."""
    p, d = named(stack, "p1"), named(stack, "d0")
    rid = uuid.uuid4().hex
    prompt = tokens("pp-disconnect", 3 * 128 + 7)
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
