"""``disagg-bench answers``: every completed answer through push equals an aggregated
instance's, under faults ("never a wrong answer with a 200").

Who calls it: :mod:`bench.answers_cmd`. One real vLLM CPU stack (our connector, 1P1D, an
aggregated instance ``a0`` beside it, every instance in float32: in bfloat16 vLLM CPU's greedy
answers change with the batch they run in, so a difference would prove nothing) and our router.

1. The reference: every prompt sent to ``a0`` twice (at the checker's concurrency, then at 4);
   where the two runs disagree only the part they agree on is compared.
2. The push run: every prompt once through the router at ``concurrency``, temperature 0, streams
   and JSON answers, with faults in the middle: a share of the requests is left by the client at
   a random moment (before P ends, between P and D, mid-stream), a share of the streams is left
   right after its first token (D's leg cancelled mid-decode), and P is killed (SIGKILL) once a
   third of the requests are done and restarted at once (requests meanwhile fail over to D
   alone or fail; a failure is allowed).
3. Every completed answer is compared with the reference; then every instance's KV usage must
   come back to 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from bench.answers import AnswerPrompt, Outcome, classify, compare, make_prompts, summarize
from bench.results import log_folder
from bench.routers import our_router
from devstack.ports import free_ports
from devstack.stack import Stack, StackInstance, StackOptions, start_stack
from devstack.vllm_server import VllmServer

BLOCK = 16
"""vLLM CPU's default block size: prompt shapes are drawn around it."""
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class AnswersSpec:
    requests: int = 1300
    concurrency: int = 32
    max_tokens: int = 16
    seed: int = 0
    abort_share: float = 0.06
    """Requests the client leaves at a random moment (up to ``abort_within_s`` after sending)."""
    abort_within_s: float = 0.4
    first_token_abort_share: float = 0.04
    """Streams the client leaves right after their first token."""
    kill_p: bool = True


@dataclass
class _Faults:
    random_aborts: int = 0
    first_token_aborts: int = 0
    p_killed_after: int | None = None
    p_restart_s: float | None = None


async def _send(
    client: httpx.AsyncClient, url: str, model: str, prompt: AnswerPrompt, spec: AnswersSpec
) -> tuple[int | None, bool, str | None, str]:
    """(status, ended cleanly, error, text) of one completion."""
    body = {"model": model, "prompt": prompt.text, "max_tokens": spec.max_tokens}
    body |= {"temperature": 0, "stream": prompt.stream}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200 or not prompt.stream:
                raw = await resp.aread()
                if resp.status_code != 200:
                    return resp.status_code, False, None, ""
                return 200, True, None, json.loads(raw)["choices"][0]["text"]
            return await _stream(resp)
    except httpx.HTTPError as exc:
        return None, False, type(exc).__name__, ""


async def _stream(resp: httpx.Response) -> tuple[int, bool, str | None, str]:
    parts: list[str] = []
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return 200, True, None, "".join(parts)
        event = json.loads(line[6:])
        if "error" in event:
            return 200, False, str(event["error"].get("type")), ""
        parts.append(event["choices"][0]["text"])
    return 200, False, None, ""


async def _first_token_then_leave(
    client: httpx.AsyncClient, url: str, model: str, prompt: AnswerPrompt, spec: AnswersSpec
) -> bool:
    """Send a stream, leave after its first token; True if the checker did leave it."""
    body = {"model": model, "prompt": prompt.text, "max_tokens": spec.max_tokens}
    body |= {"temperature": 0, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"choices"' in line:
                    return True
    except httpx.HTTPError:
        return False
    return False


async def _one(
    client: httpx.AsyncClient,
    target: tuple[str, str],
    prompt: AnswerPrompt,
    spec: AnswersSpec,
    rng: random.Random,
    faults: _Faults,
) -> Outcome:
    url, model = target
    draw = rng.random()
    if prompt.stream and draw < spec.first_token_abort_share:
        faults.first_token_aborts += 1
        left = await _first_token_then_leave(client, url, model, prompt, spec)
        return classify(None, False, "no first token", aborted=left)
    if draw < spec.first_token_abort_share + spec.abort_share:
        try:
            async with asyncio.timeout(rng.uniform(0.0, spec.abort_within_s)):
                status, done, error, text = await _send(client, url, model, prompt, spec)
        except TimeoutError:
            faults.random_aborts += 1
            return classify(None, False, None, aborted=True)
        return classify(status, done, error, False, text)
    status, done, error, text = await _send(client, url, model, prompt, spec)
    return classify(status, done, error, False, text)


async def _run_all(
    target: tuple[str, str],
    prompts: list[AnswerPrompt],
    spec: AnswersSpec,
    concurrency: int,
    on_done: Callable[[int], None] | None = None,
    faults: _Faults | None = None,
) -> dict[int, Outcome]:
    """Every prompt once, ``concurrency`` at a time; faults only when ``faults`` is given."""
    rng = random.Random(spec.seed + 1)
    queue = list(reversed(prompts))
    results: dict[int, Outcome] = {}
    limits = httpx.Limits(max_connections=concurrency * 2)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            prompt = queue.pop()
            if faults is None:
                status, done, error, text = await _send(client, *target, prompt, spec)
                results[prompt.prompt_id] = classify(status, done, error, False, text)
            else:
                results[prompt.prompt_id] = await _one(client, target, prompt, spec, rng, faults)
            if on_done is not None:
                on_done(len(results))

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


async def _kill_and_restart(stack: Stack, instance: StackInstance, faults: _Faults) -> None:
    """Kill ``instance`` as a crash would (SIGKILL, :meth:`devstack.process.ChildProcess.kill`),
    then start it again on the same port. The new
    process is launched from the event loop's thread: a dev-stack child gets its parent-death
    signal when the thread that started it ends, so a worker thread must not start it."""
    await asyncio.to_thread(instance.server.kill)
    await asyncio.to_thread(instance.server.stop)  # reaps the group
    started = time.monotonic()
    server = VllmServer(instance.server.spec)
    server.launch()
    stack.instances[stack.instances.index(instance)] = replace(instance, server=server)
    await asyncio.to_thread(server.wait_ready)
    faults.p_restart_s = round(time.monotonic() - started, 1)


async def _push_run(
    stack: Stack, url: str, prompts: list[AnswerPrompt], spec: AnswersSpec
) -> tuple[dict[int, Outcome], _Faults]:
    faults = _Faults()
    kill_at = len(prompts) // 3
    killed = asyncio.Event()
    restart: list[asyncio.Future[None]] = []

    def on_done(done: int) -> None:
        if spec.kill_p and done >= kill_at and not killed.is_set():
            killed.set()
            faults.p_killed_after = done
            again = _kill_and_restart(stack, stack.prefill[0], faults)
            restart.append(asyncio.ensure_future(again))

    results = await _run_all(
        (url, stack.model_name), prompts, spec, spec.concurrency, on_done, faults
    )
    for pending in restart:
        await pending
    return results, faults


def _kv_blocks_back_to_zero(stack: Stack, timeout_s: float = 60.0) -> dict[str, float]:
    """Each instance's ``vllm:kv_cache_usage_perc`` once all are 0 (or at ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = {i.name: i.server.load().kv_cache_usage for i in stack.instances}
        if all(value == 0 for value in usage.values()) or time.monotonic() > deadline:
            return usage
        time.sleep(0.2)


def run_answers(spec: AnswersSpec, log_dir: Path | None = None) -> dict[str, Any]:
    """Start the stack and the router, run the reference and the push run, stop everything;
    the report's data."""
    prompts = make_prompts(spec.requests, spec.seed, BLOCK)
    options = StackOptions(
        kind="ours",
        topology="1p1d",
        with_aggregated=True,
        enforce_eager=True,
        extra_args=("--dtype", "float32"),
    )
    with ExitStack() as exits:
        logs = exits.enter_context(log_folder(log_dir, "bench-answers-"))
        stack = exits.enter_context(start_stack(options, logs))
        stack.warm_up()
        a0 = (stack.aggregated[0].url, stack.model_name)
        first = asyncio.run(_run_all(a0, prompts, spec, spec.concurrency))
        second = asyncio.run(_run_all(a0, prompts, spec, 4))
        config = stack.router_config(with_identity=True, health_interval_s=1.0)
        (port,) = free_ports(1)
        exits.enter_context(our_router(config, port, logs))
        started = time.monotonic()
        results, faults = asyncio.run(_push_run(stack, f"http://127.0.0.1:{port}", prompts, spec))
        took = time.monotonic() - started
        kv_after = _kv_blocks_back_to_zero(stack)
    return _report(spec, first, second, results, faults, took, kv_after)


def _texts(outcomes: dict[int, Outcome]) -> dict[int, str]:
    return {i: o.text for i, o in outcomes.items() if o.kind == "completed"}


def _report(
    spec: AnswersSpec,
    first: dict[int, Outcome],
    second: dict[int, Outcome],
    results: dict[int, Outcome],
    faults: _Faults,
    took: float,
    kv_after: dict[str, float],
) -> dict[str, Any]:
    reference, again = _texts(first), _texts(second)
    answers = _texts(results)
    found = compare(reference, again, answers)
    return {
        "spec": asdict(spec),
        "reference": {"answers": len(reference), "second_run_answers": len(again)},
        "push": summarize(results.values()),
        "compared": found.compared,
        "mismatched": len(found.mismatched),
        "mismatched_ids": found.mismatched[:20],
        "reference_unstable": len(found.unstable),
        "faults": asdict(faults),
        "push_run_s": round(took, 1),
        "kv_cache_usage_after": kv_after,
    }
