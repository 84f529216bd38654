"""D failover on real vLLM CPU, 1P2D with our connector: concurrent streams of about 8k prompt
tokens each (8 in the test suite, 20 for the report), D0 killed (or stopped) in one window per
case; every stream must end whole.

Each case starts a new router (round robin: D0 and D1 take half the streams each), sends the
requests at once (greedy, 64 tokens, ``ignore_eos``), and when its moment comes kills D0 (SIGKILL
of its process group) or stops it (SIGSTOP; the router's ``inter_token`` of 2 s notices). What
each case checks: every stream ends with ``[DONE]`` and 64 tokens, no error event; the prompt
tokens P computed for each attempt that followed the failure (the router's log of P's usage, where
vLLM reports the prompt tokens its prefix cache served) are at most one block before the first
token and at most the tokens generated so far plus one block after it; KV usage back to 0 on
every instance still running. A killed D0 is restarted before the next case, a stopped one
continued.

With ``$FAILOVER_OUT`` set, each case also measures the report's figures, which assert nothing:
the streams' texts against an uninterrupted run of the same requests and the time a full retry
of the migrated streams takes. The table and the resume figure go to that file, the figures
beside it as JSON (``failover.json``, which ``disagg-bench report`` reads for its summary.json
keys); docs/benchmarks/failover.md, failover.json and their keys in docs/benchmarks/summary.json
are produced by

    FAILOVER_OUT=docs/benchmarks/failover.md flock /tmp/vllm-e2e.lock \\
        .venv/bin/python -m pytest -m vllm tests/e2e/test_failover_matrix.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.stack import Stack, StackInstance
from tests.e2e.e2e_support import make_prompt, metrics, running_router
from tests.e2e.failover_support import (
    OURS,
    block_size,
    failover_stack,
    restart,
    until_kv_freed,
)
from tests.support.wait import wait_until

pytestmark = OURS

REPORT = os.environ.get("FAILOVER_OUT")
"""Where the report goes; unset (as in tests/run.sh): its figure-only runs are skipped."""
REQUESTS = 20 if REPORT else 8
"""Concurrent streams per case: 8 keep every window (P's queue behind its first prefill, half
the streams on D0) in less of the test suite's time; the report's figures take 20."""
TOKENS = 64
WORDS = 2400
"""Words per prompt: about 8k tokens of the tiny model's tokenizer."""
STALL_S = 2.0
SEAM = 10
ROWS: list[dict[str, str]] = []
FIGURES: dict[str, Any] = {}
COMPUTED = re.compile(r"\(after a D failure, (\w+)\): P computed (\d+) of (\d+) prompt tokens")


@dataclass
class Stream:
    """What one client stream got: its id, texts and their arrival times, its end."""

    prompt: str
    request_id: str = ""
    texts: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    done: bool = False
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    # float32: in bfloat16 vLLM CPU's greedy answers can change with the batch they run in
    # (processors with AMX tiles), which would make a text comparison prove nothing.
    with failover_stack(e2e_dir, extra_args=("--dtype", "float32")) as started:
        yield started
    if ROWS and REPORT:
        _write(Path(REPORT))


def _body(model: str, prompt: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _read(url: str, model: str, stream: Stream) -> None:
    """Read one stream to its end into ``stream`` (in a thread of its own)."""
    body = _body(model, stream.prompt)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
            stream.request_id = resp.headers.get("x-request-id", "")
            if resp.status_code != 200:
                stream.error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                return
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    stream.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        stream.error = chunk["error"]["message"]
                    stream.usage = chunk.get("usage") or stream.usage
                    for choice in chunk.get("choices") or []:
                        stream.texts.append(choice["text"])
                        stream.times.append(time.monotonic())
    except httpx.HTTPError as exc:
        stream.error = repr(exc)


def _run(url: str, model: str, prompts: list[str], moment: Callable[[list[Stream]], bool] | None,
         act: Callable[[], None] | None) -> list[Stream]:  # fmt: skip
    """Every prompt as a concurrent stream; ``act()`` once ``moment(streams)`` holds."""
    streams = [Stream(p) for p in prompts]
    threads = [threading.Thread(target=_read, args=(url, model, s)) for s in streams]
    for thread in threads:
        thread.start()
    if moment is not None and act is not None:
        wait_until(lambda: moment(streams), timeout=240, what="the case's moment", interval=0.01)
        act()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a stream never ended"
    return streams


def _uninterrupted(stack: Stack, prompts: list[str]) -> dict[str, str]:
    """The texts of an uninterrupted run of ``prompts`` (the same concurrency)."""
    with running_router(stack, timeouts=_timeouts(), health_interval_s=3600.0) as router:
        streams = _run(router.url, stack.model_name, prompts, None, None)
    assert all(s.done and s.error is None for s in streams), [s.error for s in streams]
    return {s.prompt: s.text for s in streams}


def _timeouts(after_prefill: float = 240.0) -> dict[str, float]:
    """Bounds that a loaded machine never meets but where a case waits for one: D0 stopped
    before its first tokens is found by ``after_prefill`` (counted from P's answer, so however
    long P's queue of prompts takes on this machine, the wait it bounds is D0's alone)."""
    return {
        "prefill": 240.0,
        "first_token": 240.0,
        "after_prefill": after_prefill,
        "total": 300.0,
        "inter_token": STALL_S,
    }


def _p_started(p: StackInstance) -> Callable[[list[Stream]], bool]:
    return lambda _: metrics(p).get("vllm:num_requests_running", 0.0) > 0


def _p_finished_one(p: StackInstance, before: float) -> Callable[[list[Stream]], bool]:
    return lambda _: metrics(p).get("vllm:request_success_total", 0.0) > before


DISPATCHED = re.compile(r"^request (\w+) model=\S+ route=\S+ prefill=\S+ decode=(\S+)$")
"""The router's log line of each dispatch: its id and the D it went to."""


def _dispatched_to(caplog: pytest.LogCaptureFixture, label: str) -> set[str]:
    """The request ids the router's log says went to the D named ``label`` so far."""
    found = (DISPATCHED.match(r.getMessage()) for r in list(caplog.records))
    return {m.group(1) for m in found if m is not None and m.group(2) == label}


def _half_of_d0_past(n: int, caplog: pytest.LogCaptureFixture) -> Callable[[list[Stream]], bool]:
    """Half of D0's streams (as the router's log names them), at least one, past their ``n``-th
    token and not yet at their last. D0's own streams, not half of all: when D0 runs ahead of
    D1, its streams can end before half of all are past ``n``, and D0 would then fail with
    nothing on it."""

    def moment(streams: list[Stream]) -> bool:
        ids = _dispatched_to(caplog, "d0")
        on = [s for s in streams if s.request_id in ids]
        mid = sum(n <= len(s.texts) < TOKENS for s in on)
        return mid >= 1 and mid >= len(on) // 2

    return moment


def _full_retries(stack: Stack, count: int, tag: str) -> list[float]:
    """What a full retry of ``count`` streams takes: as many new prompts of the same length,
    at once, each to its first token (P prefills each whole, as a retry without P's cache
    would)."""
    if not count:
        return []
    prompts = [make_prompt(f"full-retry-{tag}-{i}", WORDS) for i in range(count)]
    with running_router(stack, timeouts=_timeouts(), health_interval_s=3600.0) as router:
        start = time.monotonic()
        streams = _run(router.url, stack.model_name, prompts, None, None)
    return [s.times[0] - start for s in streams]


def _kill(d: StackInstance) -> Callable[[], None]:
    return d.server.kill


def _stop(d: StackInstance, stopped: list[bool]) -> Callable[[], None]:
    def act() -> None:
        pid = d.server.pid
        assert pid is not None
        os.killpg(pid, signal.SIGSTOP)
        stopped.append(True)

    return act


AFTER_PREFILL_S = 15.0
"""``timeouts.after_prefill`` of the cases that stop D0: those of its streams that have no token
yet when it stops (all of them before the first token; in the mid-stream case, any that the
other D's streams got ahead of) are found by it, not by the 240 s a loaded machine needs."""
CASES = [
    ("kill -9 D0 while P prefills (its first prefill running, D0's registrations in)", "started",
     "kill"),
    ("kill -9 D0 between registration and WRITE (P's first prefill done, the rest queued)",
     "finished_one", "kill"),
    (f"SIGSTOP D0 while P prefills (after_prefill {AFTER_PREFILL_S:g} s)", "started", "stop"),
    (f"SIGSTOP D0 between registration and WRITE (after_prefill {AFTER_PREFILL_S:g} s)",
     "finished_one", "stop"),
    (f"kill -9 D0 once half its streams are between {SEAM} and {TOKENS} tokens", "tokens",
     "kill"),
    (f"SIGSTOP D0 once half its streams are between {SEAM} and {TOKENS} tokens (inter_token "
     f"{STALL_S:g} s: the time to resume includes it)", "tokens", "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "when", "how"), CASES, ids=[c[1] + "-" + c[2] for c in CASES])
def test_every_stream_ends_whole_when_d0_fails(
    stack: Stack,
    caplog: pytest.LogCaptureFixture,
    case: str,
    when: str,
    how: str,
) -> None:
    [p], [d0, d1] = stack.prefill, stack.decode
    block = block_size(p)
    stopped: list[bool] = []
    prompts = [make_prompt(f"failover-{when}-{how}-{i}", WORDS) for i in range(REQUESTS)]
    # Mid-stream cases: P's cache holds the prompts (the uninterrupted run goes first), so the
    # streams start together and D0 dies with streams past their 10th token; the prefill cases
    # need P computing them when D0 dies, so their uninterrupted run comes after.
    baseline = _uninterrupted(stack, prompts) if when == "tokens" else {}
    caplog.set_level("INFO", logger="disagg_router")
    after_prefill = AFTER_PREFILL_S if how == "stop" else 240.0
    timeouts = _timeouts(after_prefill)
    with running_router(stack, timeouts=timeouts, health_interval_s=3600.0) as router:
        before = metrics(p).get("vllm:request_success_total", 0.0)
        moment = {
            "started": _p_started(p),
            "finished_one": _p_finished_one(p, before),
            "tokens": _half_of_d0_past(SEAM, caplog),
        }[when]
        act = _kill(d0) if how == "kill" else _stop(d0, stopped)
        try:
            streams = _run(router.url, stack.model_name, prompts, moment, act)
        finally:
            if stopped:
                os.killpg(d0.server.pid or 0, signal.SIGCONT)
        routed = httpx.get(f"{router.url}/metrics", timeout=10).text
    computed = [(m.group(1), int(m.group(2))) for m in COMPUTED.finditer(caplog.text)]
    failed = [s.error for s in streams if not s.done or s.error]
    assert not failed, failed
    assert all(s.usage and s.usage["completion_tokens"] == TOKENS for s in streams)
    resumed = _metric(routed, 'disagg_router_stream_migrations_total{outcome="resumed"}')
    before_first = _metric(
        routed, 'disagg_router_decode_failovers_total{phase="before_first_token"'
    )
    assert resumed + before_first >= 1, "D0's failure touched no stream"
    most = {phase: max((n for ph, n in computed if ph == phase), default=0) for phase in
            ("before_first_token", "after_first_token")}  # fmt: skip
    assert most["before_first_token"] <= block, computed
    assert most["after_first_token"] <= TOKENS + block, computed
    gaps = _resume_gaps(streams, caplog.text)
    until_kv_freed((p, d1) if how == "kill" else stack.instances)
    if how == "kill":
        restart(stack, d0)
    if REPORT:
        baseline = baseline or _uninterrupted(stack, prompts)
        equal = sum(s.text == baseline[s.prompt] for s in streams)
        retries = _full_retries(stack, len(gaps), f"{when}-{how}")
        _record(case, streams, resumed, before_first, most, equal, (gaps, retries), block)


def _metric(text: str, prefix: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


def _resume_gaps(streams: list[Stream], log_text: str) -> list[float]:
    """For each migrated stream (the router logged its continuation): the time from its last
    text before the seam to its first after (its longest gap between texts)."""
    migrated = set(re.findall(r"stream (\w+): D \S+ failed after", log_text))
    return [
        max(b - a for a, b in zip(s.times, s.times[1:], strict=False))
        for s in streams
        if s.request_id in migrated and len(s.times) > 1
    ]


def _record(case: str, streams: list[Stream], resumed: float, before_first: float,
            most: dict[str, int], equal: int, times: tuple[list[float], list[float]],
            block: int) -> None:  # fmt: skip
    ok = sum(s.done and s.error is None for s in streams)
    got = (
        f"{ok}/{len(streams)} streams whole ({TOKENS} tokens, [DONE]); {resumed:g} migrated "
        f"mid-stream, {before_first:g} retried before their first token"
    )
    tokens = (
        f"before the first token at most {most['before_first_token']} (block {block}); after it "
        f"at most {most['after_first_token']}"
    )
    text = f"{equal}/{len(streams)} equal to the uninterrupted run's"
    resume = "-"
    gaps, retries = times
    if gaps and case.startswith("kill"):  # the figure: a death found at once, not a stall
        FIGURES.setdefault("resume_s", []).extend(gaps)
        FIGURES.setdefault("full_retry_s", []).extend(retries)
    if gaps:
        resume = (
            f"p50 {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s ({len(gaps)} streams); "
            f"a full retry of as many: p50 {statistics.median(retries):.2f} s"
        )
    ROWS.append({"case": case, "got": got, "tokens": tokens, "text": text, "resume": resume})
    FIGURES["completed"] = FIGURES.get("completed", 0) + ok
    FIGURES["requests"] = FIGURES.get("requests", 0) + len(streams)
    FIGURES["p_tokens_max"] = max(FIGURES.get("p_tokens_max", 0), most["after_first_token"])


def _write(out: Path) -> None:
    gaps, full = sorted(FIGURES.get("resume_s", [])), FIGURES.get("full_retry_s", [])
    p50 = statistics.median(gaps) if gaps else None
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None
    full_p50 = statistics.median(full) if full else None
    lines = [
        "# D failover: real vLLM CPU, 1P2D, our connector",
        "",
        "Produced by `FAILOVER_OUT=docs/benchmarks/failover.md flock /tmp/vllm-e2e.lock "
        ".venv/bin/python -m pytest -m vllm tests/e2e/test_failover_matrix.py` (tiny model in "
        f"float32; per case {REQUESTS} concurrent greedy streams of new prompts of about 8k "
        f"tokens and {TOKENS} tokens, a new router, round robin over D0 and D1; P's computed "
        "prompt tokens from the router's log of P's usage for each attempt after the failure; "
        "the text compared with an uninterrupted run of the same prompts; the time to resume "
        "is a migrated stream's longest gap between tokens, beside a full retry: as many new "
        "prompts of the same length sent at once, to their first token).",
        "",
        "| case | what the clients got | prompt tokens P computed per attempt after the failure "
        "| text (temperature 0) | time to resume |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['case']} | {r['got']} | {r['tokens']} | {r['text']} | {r['resume']} |" for r in ROWS
    ]
    ratio = p50 / full_p50 if p50 is not None and full_p50 else None
    if ratio is not None:
        lines += [
            "",
            f"Time to resume a stream migrated after its D was killed: p50 {p50:.2f} s, p99 "
            f"{p99:.2f} s over "
            f"{len(gaps)} streams; a full retry of as many streams: p50 {full_p50:.2f} s; "
            f"ratio {ratio:.2f} (`migration_resume_over_full_retry`).",
        ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    keys = {
        "migration_resume_over_full_retry": ratio,
        "migration_completed_fraction": FIGURES["completed"] / FIGURES["requests"],
        "migration_p_prompt_tokens_max": FIGURES.get("p_tokens_max"),
    }
    record = {"rows": ROWS, "figures": FIGURES, "summary": keys}
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    summary = out.parent / "summary.json"  # the keys also go into a summary.json beside it
    if os.environ.get("FAILOVER_OUT") and summary.exists():
        summary.write_text(json.dumps({**json.loads(summary.read_text()), **keys}, indent=2) + "\n")
