"""The connector end to end: real vLLM CPU 1P1D, our connector vs vLLM's ``NixlPushConnector``.

A small two-leg client (P leg ``max_tokens=1`` with ``do_remote_decode``; D leg sent at the same
time with P's identity and the same ``X-Request-Id`` and ``transfer_id``) so these tests depend on
the connector only, not on the router. Prompts are token-id lists of exact lengths, so "1 block",
"many blocks" and "not block aligned" are exact (CPU block size: 128 tokens). Outputs are
compared with an aggregated request to P (a plain request without ``kv_transfer_params``),
tokens exactly and per-token log-probabilities closely, so a wrong or missing block shows.

The failure-path tests (abort while waiting, P killed) run for our connector only: vLLM 0.32's
push connector leaves those paths open (D waits up to ``push_registration_timeout``, 480 s).
Run under ``flock /tmp/vllm-e2e.lock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devstack.stack import Stack, StackInstance, StackOptions
from disagg_router.connector.contract import (
    KV_TRANSFER_PARAMS,
    PeerIdentity,
    decode_leg_params,
    identity_probe_params,
    pairing_refusal,
    prefill_leg_params,
    read_engine_shape,
    read_prefill_answer,
)
from tests.e2e.e2e_support import metrics, module_stack, wait_idle
from tests.support.wait import wait_until

pytestmark = [pytest.mark.vllm]

BLOCK = 128
MAX_TOKENS = 12
TRANSFER_TIMEOUT_S = 20.0
TIMEOUT = httpx.Timeout(180.0, connect=10.0)
# Sized for the tiny model's bfloat16 logits (8 significant bits; the instances here run in
# float32, below, where it holds with room to spare). D decoding a batch of requests
# rounds differently from P answering one at a time: a log-probability may move by a unit or two
# in the last place of a bfloat16 number near its magnitude (a unit is 2**-5 between 4 and 8), so
# the tolerance is two such units, relative. A wrong or missing block changes the tokens
# (compared exactly) and moves log-probabilities by far more.
LOGPROB_REL = 2**-6
FLOAT32 = ("--dtype", "float32")
"""The instances compute in float32: on a processor with AMX tiles, vLLM CPU's bfloat16 matmuls
round differently with the batch a request runs in, enough to change a greedy token now and
then, which would fail the comparisons below without any fault in the KV."""
LOG_REQUESTS = ("--enable-log-requests",)
"""vLLM logs ``Added request <id>`` once its API server has handed a request to the engine and
``Aborted request(s) <id>`` once it has sent the engine the abort (INFO: ids and sampling
parameters, no prompts); :func:`abort_p_leg_before_prefill_ends` orders its steps by them."""
OURS_EXTRA = {"transfer_timeout_s": TRANSFER_TIMEOUT_S, "liveness_interval_s": 0.5}


@pytest.fixture(
    scope="module",
    params=["ours", pytest.param("vllm-push", marks=pytest.mark.upstream_push)],
)
def stack(request: pytest.FixtureRequest, e2e_dir: Path) -> Iterator[Stack]:
    kind: str = request.param
    extra = OURS_EXTRA if kind == "ours" else {}
    options = StackOptions(
        kind=kind,
        connector_extra_config=extra,
        enforce_eager=True,
        extra_args=FLOAT32 + LOG_REQUESTS,
    )
    with module_stack(options, e2e_dir) as s:
        yield s


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def _body(prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def identity(p: StackInstance, rid: str) -> dict[str, Any]:
    """The D leg's ``kv_transfer_params``, built with the contract's builder (as the router)."""
    assert p.engine_id is not None and p.side_channel_port is not None
    return decode_leg_params(
        engine_id=p.engine_id,
        host="127.0.0.1",
        port=p.side_channel_port,
        tp_size=1,
        pp_size=1,
        request_id=f"cmpl-{rid}-0",
        transfer_id=rid,
    )


async def disagg(client: httpx.AsyncClient, stack: Stack, prompt: list[int]) -> dict[str, Any]:
    """Both legs at once; returns D's JSON (raises on a non-200 leg)."""
    return (await disagg_legs(client, stack, prompt, uuid.uuid4().hex))[1]


async def disagg_legs(
    client: httpx.AsyncClient, stack: Stack, prompt: list[int], rid: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both legs at once under request id ``rid``; returns P's and D's JSON (raises on a
    non-200 leg)."""
    p, d = stack.prefill[0], stack.decode[0]
    headers = {"X-Request-Id": rid}
    p_params = prefill_leg_params(rid)
    p_leg = client.post(p.url + "/v1/completions", headers=headers, json=_body(prompt, 1, p_params))
    d_leg = client.post(
        d.url + "/v1/completions", headers=headers, json=_body(prompt, MAX_TOKENS, identity(p, rid))
    )
    p_resp, d_resp = await asyncio.gather(p_leg, d_leg)
    assert p_resp.status_code == 200, p_resp.text
    assert d_resp.status_code == 200, d_resp.text
    return p_resp.json(), d_resp.json()


def check_prefill_answer(stack: Stack, params: dict[str, Any], rid: str, length: int) -> None:
    """P's real answer reads with the contract's reader (the one the router uses), and ours
    says what the connector sent: P's identity, its request id, the blocks it keeps."""
    answer = read_prefill_answer(params)
    p = stack.prefill[0]
    assert answer.peer.engine_id == p.engine_id
    if stack.options.kind != "ours":
        return
    assert answer.peer == PeerIdentity(p.engine_id, "127.0.0.1", p.side_channel_port)
    assert answer.request_id is not None and answer.request_id.startswith(f"cmpl-{rid}-0-")
    assert answer.transfer_id == rid and answer.transfer_mode == "push"
    assert answer.num_tokens == length
    assert answer.block_ids is not None and len(answer.block_ids) >= -(-length // BLOCK)


async def aggregated(client: httpx.AsyncClient, stack: Stack, prompt: list[int]) -> dict[str, Any]:
    resp = await client.post(
        stack.prefill[0].url + "/v1/completions", json=_body(prompt, MAX_TOKENS, None)
    )
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def assert_same(got: dict[str, Any], ref: dict[str, Any]) -> None:
    g, r = got["choices"][0], ref["choices"][0]
    assert g["text"] == r["text"]
    g_lp, r_lp = g["logprobs"]["token_logprobs"], r["logprobs"]["token_logprobs"]
    assert g["logprobs"]["tokens"] == r["logprobs"]["tokens"]
    assert g_lp == pytest.approx(r_lp, rel=LOGPROB_REL, abs=2e-2)


EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def kv_usage(instance: StackInstance) -> float:
    return metrics(instance).get("vllm:kv_cache_usage_perc", -1.0)


def idle_kv_usage(instance: StackInstance) -> float:
    """The instance's KV usage once it serves nothing (the baseline a test returns to)."""
    wait_idle(instance, 60.0, f"{instance.name} to be idle")
    return kv_usage(instance)


async def wait_kv_back(instance: StackInstance, baseline: float) -> None:
    """Wait until the instance's KV usage is back at ``baseline`` (its blocks were freed)."""
    await asyncio.to_thread(
        wait_until,
        lambda: kv_usage(instance) <= baseline + 1e-9,
        15.0,
        f"{instance.name}'s KV usage back to {baseline}",
        0.25,
    )


def kv_loads_in_progress(instance: StackInstance) -> float:
    """D's requests whose KV load has started (registered with P) and not finished yet."""
    response = httpx.get(instance.url + "/metrics", timeout=httpx.Timeout(10.0))
    response.raise_for_status()
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "vllm:num_requests_kv_fetch_by_stage"
        and sample.labels.get("stage") == "in_progress"
    )


async def wait_registered(d: StackInstance) -> None:
    """Wait until D has started the KV load of its request, i.e. registered it with P."""
    await asyncio.to_thread(
        wait_until,
        lambda: kv_loads_in_progress(d) >= 1,
        60.0,
        "D to register its request with P (a KV load in progress)",
        0.1,
    )


@contextlib.contextmanager
def engine_frozen(instance: StackInstance) -> Iterator[None]:
    """Stop (``SIGSTOP``) every process under the instance's API server (its engine core and,
    for TP/PP, its workers) and continue them on leaving, however it is left. The API server
    itself keeps serving: what it sends the engine waits in the engine's socket, in order."""
    pid = instance.server.pid
    assert pid is not None, f"{instance.name} is not running"
    stopped: list[psutil.Process] = []
    try:
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.suspend()
                stopped.append(child)
        yield
    finally:
        for child in stopped:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.resume()


async def abort_p_leg_before_prefill_ends(
    client: httpx.AsyncClient, p: StackInstance, p_body: dict[str, Any], rid: str
) -> None:
    """Send the P leg of ``rid`` and go away before P's prefill can end, whatever the machine's
    speed: P's engine is frozen while its API server hands it the request (``Added request``)
    and, once the client has gone, the abort (``Aborted request``); the engine, continued, reads
    both in order and aborts the request queued, or after at most the chunk under way of a
    prompt several chunks long. P must be idle first and run with :data:`LOG_REQUESTS`."""
    await asyncio.to_thread(wait_idle, p, 60.0, "P to be idle before the prefill to abort")
    with engine_frozen(p):
        p_leg = asyncio.ensure_future(
            client.post(p.url + "/v1/completions", json=p_body, headers={"X-Request-Id": rid})
        )
        try:
            await wait_logged(p, f"Added request cmpl-{rid}", p_leg)
        finally:
            p_leg.cancel()
        with pytest.raises(asyncio.CancelledError):
            await p_leg
        await wait_logged(p, f"Aborted request(s) cmpl-{rid}", None)


async def wait_logged(
    instance: StackInstance, text: str, leg: asyncio.Future[httpx.Response] | None
) -> None:
    """Poll the instance's log until a line holds ``text``; fail with the leg's answer if
    ``leg`` ends first, or after 60 s with the log's tail."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60.0
    while not any(text in line for line in log_tail(instance, 200).splitlines()):
        if leg is not None and leg.done():
            answer = leg.result()
            pytest.fail(f"{instance.name} answered first: {answer.status_code} {answer.text[:300]}")
        if loop.time() >= deadline:
            pytest.fail(f"{instance.name} never logged {text!r}; its log:\n{log_tail(instance)}")
        await asyncio.sleep(0.05)


def log_tail(instance: StackInstance, lines: int = 40) -> str:
    """The last ``lines`` lines of an instance's log, its ``/metrics`` scrapes left out (after
    a 60 s poll every 10 ms they fill the tail ``server.log_tail`` would give)."""
    text = instance.server.log_path.read_text(errors="replace")
    kept = [line for line in text.splitlines() if "GET /metrics" not in line]
    return "\n".join(kept[-lines:])


def failed_transfer_line(d: StackInstance, rid: str) -> str:
    """The line D's connector logged for the failed transfer of ``rid`` ('' until it did)."""
    text = d.server.log_path.read_text(errors="replace")
    return next(
        (line for line in text.splitlines() if rid in line and "side=receiver ok=False" in line),
        "",
    )


def log_lines(stack: Stack, needle: str) -> str:
    """Every instance's log lines that mention ``needle`` (a request or transfer id), for a
    failure message that shows what each side did."""
    out = []
    for inst in stack.instances:
        text = inst.server.log_path.read_text(errors="replace")
        out += [f"{inst.name}: {line}" for line in text.splitlines() if needle in line]
    return "\n".join(out)


async def assert_failed_by_p_abort(stack: Stack, d: StackInstance, rid: str) -> None:
    """D failed the transfer of ``rid`` with P's abort as the reason (P's notification, or its
    refusal of a late registration), not by one of D's own bounds; else fail with every
    instance's log lines for ``rid``."""
    reason = await wait_failure_reason(d, rid)
    if not re.search(r"P (failed|refused): prefill ended with status FINISHED_ABORTED", reason):
        pytest.fail(f"D failed the transfer for another reason: {reason}\n{log_lines(stack, rid)}")


async def wait_failure_reason(d: StackInstance, rid: str) -> str:
    """The reason D's connector gave for the failed transfer of ``rid`` (its log line)."""
    line: str = await asyncio.to_thread(
        wait_until,
        lambda: failed_transfer_line(d, rid),
        15.0,
        f"D's connector to log the failed transfer of {rid}",
        0.25,
    )
    return line


@pytest.mark.parametrize(
    "length", [BLOCK, 5 * BLOCK + 17, 300, 40], ids=["1block", "many", "unaligned", "short"]
)
async def test_output_equals_aggregated(stack: Stack, length: int) -> None:
    prompt = tokens(f"len-{length}-{stack.options.kind}", length)
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        ref = await aggregated(client, stack, prompt)
        before = metrics(stack.decode[0])
        rid = uuid.uuid4().hex
        p_json, got = await disagg_legs(client, stack, prompt, rid)
    assert_same(got, ref)
    assert got["usage"]["prompt_tokens"] == length
    check_prefill_answer(stack, p_json[KV_TRANSFER_PARAMS], rid, length)
    # The whole prompt came from P through the connector (D computed none of it itself).
    assert delta(before, metrics(stack.decode[0]), EXTERNAL_HITS) == length


def test_identity_probes_answer_each_engines_shape(stack: Stack) -> None:
    """P's probe answer and D's bare probe answer (the router's) carry the engine's shape, and
    the 1P1D stack is a pair the connector serves."""
    if stack.options.kind != "ours":
        pytest.skip("shapes are our connector's")
    p, d = stack.prefill[0], stack.decode[0]
    p_body = _body(tokens("p-probe", 4), 1, prefill_leg_params(uuid.uuid4().hex, probe=True))
    d_body = _body(tokens("d-probe", 4), 1, identity_probe_params())
    p_resp = httpx.post(p.url + "/v1/completions", json=p_body, timeout=TIMEOUT)
    d_resp = httpx.post(d.url + "/v1/completions", json=d_body, timeout=TIMEOUT)
    assert p_resp.status_code == 200 and d_resp.status_code == 200, (p_resp.text, d_resp.text)
    p_shape = read_engine_shape(p_resp.json()[KV_TRANSFER_PARAMS])
    d_shape = read_engine_shape(d_resp.json()[KV_TRANSFER_PARAMS])
    assert p_shape is not None and d_shape is not None
    assert (d_shape.tp_size, d_shape.pp_size, d_shape.block_size) == (1, 1, BLOCK)
    assert d_shape.num_kv_heads is not None and p_shape == d_shape
    assert pairing_refusal(p_shape, d_shape) is None


async def test_prefix_hit_on_d_transfers_only_the_tail(stack: Stack) -> None:
    d = stack.decode[0]
    head = tokens(f"head-{stack.options.kind}", 2 * BLOCK)
    full = head + tokens(f"tail-{stack.options.kind}", BLOCK + 50)
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        await disagg(client, stack, head)
        ref = await aggregated(client, stack, full)
        before = metrics(d)
        got = await disagg(client, stack, full)
    after = metrics(d)
    assert_same(got, ref)
    assert delta(before, after, "vllm:prefix_cache_hits_total") == 2 * BLOCK
    assert delta(before, after, EXTERNAL_HITS) == len(full) - 2 * BLOCK
    if stack.options.kind == "ours":
        # D's connector stats: only the 2 blocks D lacked came over the wire.
        blocks = after.get("disagg_push_transfer_blocks_total", 0.0)
        blocks -= before.get("disagg_push_transfer_blocks_total", 0.0)
        assert blocks in (0.0, 2.0)  # stats reach /metrics on vLLM's logging interval


async def test_sixteen_concurrent_requests_all_correct(stack: Stack) -> None:
    prompts = [tokens(f"conc-{i}-{stack.options.kind}", 150 + 37 * i) for i in range(16)]
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        refs = [await aggregated(client, stack, p) for p in prompts]
        gots = await asyncio.gather(*(disagg(client, stack, p) for p in prompts))
    for got, ref in zip(gots, refs, strict=True):
        assert_same(got, ref)


def _ours_only(stack: Stack) -> None:
    if stack.options.kind != "ours":
        pytest.skip("vLLM 0.32's NixlPushConnector leaves this failure path open")


async def test_abort_waiting_d_request_leaks_no_blocks(stack: Stack) -> None:
    _ours_only(stack)
    p, d = stack.prefill[0], stack.decode[0]
    baseline = idle_kv_usage(d)
    rid = uuid.uuid4().hex
    body = _body(tokens("abort", 4 * BLOCK), MAX_TOKENS, identity(p, rid)) | {"stream": True}
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        # D leg only (no P leg): D registers and waits; the client then goes away.
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream(
                "POST",
                d.url + "/v1/completions",
                json=body,
                headers={"X-Request-Id": rid},
                timeout=httpx.Timeout(3.0, connect=10.0),
            ) as resp:
                async for _ in resp.aiter_bytes():
                    pass
    await wait_kv_back(d, baseline)
    values = metrics(d)
    assert values["vllm:num_requests_waiting"] == 0


# Runs before the kill-P test below, which leaves this module's stack without a live P.
async def test_p_abort_fails_waiting_d_fast_and_frees_blocks(stack: Stack) -> None:
    _ours_only(stack)
    p, d = stack.prefill[0], stack.decode[0]
    baseline = idle_kv_usage(d)
    rid = uuid.uuid4().hex
    # The longest prompt the instances take: P prefills it in chunks over several steps, and
    # the abort reaches P's engine before the first of them ends.
    prompt = tokens("p-abort", 16000)
    headers = {"X-Request-Id": rid}
    p_params = prefill_leg_params(rid)
    p_body = _body(prompt, 1, p_params) | {"stream": True}
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        d_leg = asyncio.ensure_future(
            client.post(
                d.url + "/v1/completions",
                headers=headers,
                json=_body(prompt, MAX_TOKENS, identity(p, rid)),
            )
        )
        await wait_registered(d)
        await abort_p_leg_before_prefill_ends(client, p, p_body, rid)
        resp_d = await d_leg
    assert resp_d.status_code >= 400  # P told D; D reports the load as failed
    # P's failure ended D's wait, not D's 20 s transfer timeout.
    await assert_failed_by_p_abort(stack, d, rid)
    await wait_kv_back(d, baseline)


async def test_killing_p_fails_d_within_bound_and_frees_blocks(stack: Stack) -> None:
    _ours_only(stack)
    p, d = stack.prefill[0], stack.decode[0]
    baseline = idle_kv_usage(d)
    rid = uuid.uuid4().hex
    body = _body(tokens("kill-p", 3 * BLOCK), MAX_TOKENS, identity(p, rid))
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        d_leg = asyncio.ensure_future(
            client.post(d.url + "/v1/completions", json=body, headers={"X-Request-Id": rid})
        )
        await wait_registered(d)
        assert not d_leg.done()  # D waits for the WRITE
        await asyncio.to_thread(p.server.kill)  # P dies without saying anything
        resp = await d_leg
    assert resp.status_code >= 400  # the load failed; vLLM reports it as an error
    p.server.stop(grace_s=0.0)  # reap the killed group
    # D found P gone (liveness pings, or a refused side channel), not by its transfer timeout.
    reason = await wait_failure_reason(d, rid)
    assert re.search(r"is gone|P unreachable", reason), reason
    assert "timed out" not in reason
    await wait_kv_back(d, baseline)
    # D still serves plain requests afterwards.
    plain = httpx.post(
        d.url + "/v1/completions", timeout=TIMEOUT, json=_body(tokens("after", 20), 2, None)
    )
    assert plain.status_code == 200
