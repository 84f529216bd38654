"""The emulator's scheduler (``devstack.emulator.scheduler``) driven step by step: the token
budget and chunked prefill, one token per decode step, ``max_num_seqs``, prefix-cache hits (never
the prompt's last token), recompute preemption of the most recently started request, the P leg
held until released, the D leg that allocates its prompt's blocks and waits for its KV, and abort
in every phase freeing the request's blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from devstack.emulator.blocks import BlockPool
from devstack.emulator.scheduler import GENERATED_TOKEN_ID, Limits, Phase, Role, Scheduler, Seq

SIZE = 4


def _scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, SIZE), Limits(budget, max_seqs))


def _seq(rid: str, prompt: int, max_tokens: int, first: int = 1, role: Role = "local") -> Seq:
    return Seq(rid, list(range(first, first + prompt)), max_tokens, role=role)


@dataclass
class Trace:
    """What :func:`drive` saw: per step, ``(rid, tokens)`` scheduled and the rids produced."""

    steps: list[list[tuple[str, int]]] = field(default_factory=list)
    produced: list[list[str]] = field(default_factory=list)
    running: list[int] = field(default_factory=list)


def drive(sched: Scheduler, limit: int = 200) -> Trace:
    """Step until nothing runs or waits; every step must schedule something."""
    trace = Trace()
    while sched.has_work():
        assert len(trace.steps) < limit, "the scheduler never finished"
        step = sched.schedule()
        assert step.items, "work left but nothing scheduled"
        assert step.tokens == sum(n for _, n in step.items)
        assert step.tokens <= sched.limits.max_num_batched_tokens
        trace.running.append(len(sched.running))
        trace.steps.append([(seq.rid, n) for seq, n in step.items])
        trace.produced.append([seq.rid for seq in sched.finish(step)])
    return trace


def _phase(seq: Seq) -> Phase:
    """``seq``'s phase now (read through a call: a method may have changed it)."""
    return seq.phase


def _all_free(sched: Scheduler) -> bool:
    return sched.pool.free_blocks == sched.pool.num_blocks


def test_prompts_longer_than_the_budget_are_chunked_over_steps() -> None:
    sched = _scheduler(budget=8)
    a, b = _seq("a", 10, 2), _seq("b", 10, 2, first=100)
    sched.add(a)
    sched.add(b)
    trace = drive(sched)
    assert trace.steps == [
        [("a", 8)],  # a's first chunk takes the whole budget
        [("a", 2), ("b", 6)],  # a's prefill ends, b starts with what is left
        [("a", 1), ("b", 4)],  # a decodes one token, b's prefill ends
        [("b", 1)],
    ]
    assert trace.produced == [[], ["a"], ["a", "b"], ["b"]]
    assert a.generated == b.generated == 2
    assert a.tokens[10:] == [GENERATED_TOKEN_ID, GENERATED_TOKEN_ID + 1]
    assert _all_free(sched)


def test_a_decoding_request_takes_one_token_per_step() -> None:
    sched = _scheduler()
    seq = _seq("a", 6, 5)
    sched.add(seq)
    trace = drive(sched)
    assert trace.steps == [[("a", 6)]] + [[("a", 1)]] * 4
    assert trace.produced == [["a"]] * 5
    assert len(seq.tokens) == 11 and seq.phase is Phase.DONE


def test_max_num_seqs_bounds_the_running_requests() -> None:
    sched = _scheduler(max_seqs=2)
    seqs = [_seq(rid, 3, 2, first=10 * i) for i, rid in enumerate("abc")]
    for seq in seqs:
        sched.add(seq)
    trace = drive(sched)
    assert max(trace.running) == 2
    assert trace.steps[0] == [("a", 3), ("b", 3)]
    # c starts only once a and b are done
    started = next(i for i, step in enumerate(trace.steps) if ("c", 3) in step)
    assert started == 2 and all(s.generated == 2 for s in seqs)


def test_a_repeated_prompt_starts_from_the_prefix_cache() -> None:
    sched = _scheduler()
    first = _seq("a", 10, 1)
    sched.add(first)
    drive(sched)
    assert first.prefix_hit_tokens == 0
    again = _seq("b", 10, 1)
    sched.add(again)
    trace = drive(sched)
    assert again.prefix_hit_tokens == 8  # both full blocks
    assert trace.steps == [[("b", 2)]]  # only the tokens after them are computed
    assert (sched.pool.queries, sched.pool.hits) == (20, 8)


def test_the_prompts_last_token_is_never_a_prefix_cache_hit() -> None:
    sched = _scheduler()
    sched.add(_seq("a", 8, 1))  # exactly two full blocks
    drive(sched)
    again = _seq("b", 8, 1)
    sched.add(again)
    trace = drive(sched)
    assert again.prefix_hit_tokens == 4
    assert trace.steps == [[("b", 4)]]


def test_a_request_short_of_blocks_preempts_the_most_recently_started_one() -> None:
    sched = _scheduler(num_blocks=2)
    a, b = _seq("a", 3, 4), _seq("b", 3, 4, first=100)
    sched.add(a)
    sched.add(b)
    for _ in range(2):  # both prefill, then both decode into their one block
        sched.finish(sched.schedule())
    assert (a.generated, b.generated) == (2, 2)
    assert sched.pool.free_blocks == 0

    step = sched.schedule()  # a needs a second block: b, started after it, gives its own
    assert [(s.rid, n) for s, n in step.items] == [("a", 1)]
    assert b.phase is Phase.WAITING and list(sched.waiting) == [b]
    assert (b.blocks, b.computed, b.preemptions, sched.preemptions) == ([], 0, 1, 1)
    assert len(a.blocks) == 2
    sched.finish(step)

    trace = drive(sched)
    # b starts over from its prompt and what it had generated, and ends with all its tokens
    assert trace.steps == [[("a", 1)], [("b", 5)], [("b", 1)]]
    assert a.generated == b.generated == 4
    assert b.tokens == [100, 101, 102] + [GENERATED_TOKEN_ID + i for i in range(4)]
    assert sched.preemptions == 1
    assert _all_free(sched)


def test_a_step_that_preempts_starts_no_waiting_request() -> None:
    sched = _scheduler(num_blocks=3)
    a, b = _seq("a", 3, 4), _seq("b", 3, 4, first=100)
    sched.add(a)
    sched.add(b)
    for _ in range(2):
        sched.finish(sched.schedule())
    late = _seq("c", 1, 1, first=200)
    sched.add(late)
    step = sched.schedule()  # a takes the free block, b has none left and preempts itself
    assert sched.preemptions == 1
    assert [(s.rid, n) for s, n in step.items] == [("a", 1)]
    # b's block is free again and would hold c, but a step that preempts starts nothing
    assert sched.pool.free_blocks == 1
    assert late.phase is Phase.WAITING
    assert [s.rid for s in sched.waiting] == ["b", "c"]
    for seq in (a, b, late):
        sched.abort(seq)
    assert _all_free(sched)


def test_a_prefill_leg_holds_its_blocks_until_released() -> None:
    sched = _scheduler()
    seq = _seq("p", 10, 1, role="prefill")
    sched.add(seq)
    trace = drive(sched)
    assert trace.produced == [["p"]]
    assert seq.phase is Phase.HELD and seq.generated == 1
    assert len(seq.blocks) == 3
    assert sched.pool.free_blocks == sched.pool.num_blocks - 3
    assert not sched.has_work()
    sched.release(seq)
    assert _phase(seq) is Phase.DONE and _all_free(sched)


def test_a_decode_leg_allocates_its_prompt_and_waits_for_its_kv() -> None:
    sched = _scheduler()
    seq = _seq("d", 10, 3, role="decode")
    sched.add(seq)
    step = sched.schedule()
    assert step.items == ()
    assert seq.phase is Phase.REMOTE_KV and sched.awaiting_kv == {seq}
    assert len(seq.blocks) == 3 and sched.pool.free_blocks == sched.pool.num_blocks - 3
    assert sched.drain_registered() == [seq]
    assert sched.drain_registered() == []
    assert sched.schedule().items == ()  # nothing until the KV is here
    assert not sched.has_work()

    sched.kv_arrived(seq)
    assert sched.awaiting_kv == set() and seq.kv_loaded
    step = sched.schedule()
    assert [(s.rid, n) for s, n in step.items] == [("d", 1)]  # only the prompt's last token
    assert sched.finish(step) == [seq]
    assert seq.generated == 1
    trace = drive(sched)
    assert trace.steps == [[("d", 1)]] * 2
    assert seq.generated == 3 and _all_free(sched)


def _abort_in(phase: Phase) -> Scheduler:
    sched = _scheduler(budget=4)
    roles: dict[Phase, Role] = {Phase.REMOTE_KV: "decode", Phase.HELD: "prefill"}
    role = roles.get(phase, "local")
    seq = _seq("x", 10, 3, role=role)
    sched.add(seq)
    if phase is not Phase.WAITING:
        step = sched.schedule()  # running: its first chunk; remote_kv: registered
        if phase is Phase.HELD:
            drive(sched)
        elif phase is Phase.RUNNING:
            sched.finish(step)
    assert seq.phase is phase
    sched.abort(seq)
    assert seq.phase is Phase.DONE and seq.blocks == []
    assert seq not in sched.waiting and seq not in sched.running
    assert seq not in sched.awaiting_kv
    sched.abort(seq)  # idempotent
    return sched


@pytest.mark.parametrize(
    "phase", [Phase.WAITING, Phase.RUNNING, Phase.REMOTE_KV, Phase.HELD], ids=lambda p: p.value
)
def test_abort_in_any_phase_frees_the_requests_blocks(phase: Phase) -> None:
    sched = _abort_in(phase)
    assert _all_free(sched)
    assert not sched.has_work()


def test_a_request_aborted_during_its_step_produces_nothing() -> None:
    sched = _scheduler()
    seq = _seq("x", 6, 2)
    sched.add(seq)
    step = sched.schedule()
    sched.abort(seq)
    assert sched.finish(step) == []
    assert seq.generated == 0 and _all_free(sched)


def test_a_prefix_hit_block_is_not_evicted_to_make_room_for_its_own_request() -> None:
    sched = _scheduler(num_blocks=4)
    sched.add(_seq("a", 5, 1))  # caches its first block
    drive(sched)
    sched.add(_seq("c", 9, 1, first=100))  # takes the other three blocks, then frees them
    drive(sched)
    sched.pool.drain_events()
    # a's cached block is now the least recently freed one, at the head of the free queue
    again = _seq("b", 5, 3)
    sched.add(again)
    sched.schedule()
    assert again.prefix_hit_tokens == 4
    assert len(set(again.blocks)) == len(again.blocks)  # fails: blocks == [0, 0]
    assert sched.pool.drain_events() == []  # fails: the hit block's BlockRemoved


def test_decode_legs_whose_kv_arrived_respect_max_num_seqs() -> None:
    sched = _scheduler(max_seqs=1)
    legs = [_seq(f"d{i}", 10, 3, role="decode") for i in range(2)]
    for seq in legs:
        sched.add(seq)
    sched.schedule()  # neither runs: both register and wait for their KV
    assert sched.awaiting_kv == set(legs)
    for seq in legs:
        sched.kv_arrived(seq)
    step = sched.schedule()
    assert len(sched.running) <= 1  # fails: 2
    assert len(step.items) <= 1  # fails: both decode in one step
