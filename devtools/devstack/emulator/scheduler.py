"""The emulated engine's scheduler: vLLM v1's continuous batching over a paged KV cache, as a
pure state machine (no clock, no threads, no I/O).

Who uses it: :class:`devstack.emulator.engine.Engine` calls :meth:`Scheduler.schedule` for the
next step, runs it for the profile's step time, then :meth:`Scheduler.finish` to apply it; it adds
and aborts requests and tells a decode leg's KV has arrived (:meth:`Scheduler.kv_arrived`).
Tests drive it step by step.

Each step has a token budget (``max_num_batched_tokens``). Running requests go first, in the
order they started: a decoding one takes one token, a prefilling one a chunk of what is left
(chunked prefill). A request that needs a block when none is free preempts the most recently
started running request (vLLM's recompute preemption: its blocks are freed and it starts over
from the waiting queue's head, the prefix cache permitting). Then, if nothing was preempted,
waiting requests start in arrival order while the budget, ``max_num_seqs`` and free blocks allow,
each first taking what the prefix cache holds of its prompt. A request's tokens are its prompt
then what it generated; when every known token is computed, the step produces the next one.

Three kinds of request: ``local`` (prefill and decode here), ``prefill`` (a P leg: one token,
then its blocks are *held* for a decode instance until :meth:`Scheduler.release`), ``decode`` (a
D leg: when it leaves the waiting queue it allocates its whole prompt's blocks at once and waits
for the remote KV, as vLLM's connectors do; :meth:`Scheduler.kv_arrived` puts it back at the
waiting queue's head, all but the prompt's last token computed, so the first step it is admitted
to, under the same limits as any request, yields its first token).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from devstack.emulator.blocks import BlockPool, block_hashes

Role = Literal["local", "prefill", "decode"]
GENERATED_TOKEN_ID = 1000
"""The id of the ``i``-th token an emulated engine generates is this plus ``i``."""


class Phase(enum.Enum):
    WAITING = "waiting"
    REMOTE_KV = "remote_kv"  # a D leg holding its blocks, waiting for P's KV
    RUNNING = "running"
    HELD = "held"  # a finished P leg whose blocks wait for D
    DONE = "done"


@dataclass(eq=False)
class Seq:
    """One request inside the engine."""

    rid: str
    tokens: list[int]
    max_tokens: int
    role: Role = "local"
    prompt_len: int = 0
    computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    cached_blocks: int = 0  # leading blocks already in the prefix cache
    prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache when it started
    kv_loaded: bool = False
    preemptions: int = 0
    phase: Phase = Phase.WAITING

    def __post_init__(self) -> None:
        self.prompt_len = self.prompt_len or len(self.tokens)


@dataclass(frozen=True)
class Step:
    """What one engine step computes: ``(request, tokens)`` pairs and the step model's inputs."""

    items: tuple[tuple[Seq, int], ...]
    tokens: int
    context: int
    pairs: int


@dataclass(frozen=True)
class Limits:
    """The scheduler's settings (vLLM's flags of the same names)."""

    max_num_batched_tokens: int
    max_num_seqs: int


class Scheduler:
    """One engine's request queues over one :class:`BlockPool`."""

    def __init__(self, pool: BlockPool, limits: Limits) -> None:
        self.pool = pool
        self.limits = limits
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.registered: list[Seq] = []  # D legs that allocated their blocks since last drained
        self.awaiting_kv: set[Seq] = set()  # D legs holding blocks, their KV not yet here
        self.preemptions = 0

    def add(self, seq: Seq) -> None:
        """Queue a new request."""
        self.waiting.append(seq)

    def abort(self, seq: Seq) -> None:
        """Drop ``seq`` wherever it is and free its blocks (idempotent)."""
        if seq.phase is Phase.DONE:
            return
        if seq.phase is Phase.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.phase is Phase.REMOTE_KV:
            self.awaiting_kv.discard(seq)
        elif seq.phase is Phase.RUNNING:
            self.running.remove(seq)
        self._end(seq)

    def release(self, seq: Seq) -> None:
        """A held P leg's KV went to D (or its lease passed): free its blocks."""
        if seq.phase is Phase.HELD:
            self._end(seq)

    def kv_arrived(self, seq: Seq) -> None:
        """The remote KV of D leg ``seq`` is in its blocks: it decodes from the next step."""
        if seq.phase is not Phase.REMOTE_KV:
            return
        self.awaiting_kv.discard(seq)
        seq.kv_loaded = True
        seq.computed = seq.prompt_len - 1
        seq.phase = Phase.WAITING
        self.waiting.appendleft(seq)  # it came before every request still waiting

    def has_work(self) -> bool:
        """Whether a request is running or waiting (a caller stepping by hand stops when not)."""
        return bool(self.running or self.waiting)

    def _end(self, seq: Seq) -> None:
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.phase = Phase.DONE

    def schedule(self) -> Step:
        """The next step (no items: nothing can run now)."""
        budget = self.limits.max_num_batched_tokens
        items: list[tuple[Seq, int]] = []
        preempted = self._schedule_running(items, budget)
        budget -= sum(n for _, n in items)
        if not preempted:
            self._schedule_waiting(items, budget)
        return _step(items)

    def _schedule_running(self, items: list[tuple[Seq, int]], budget: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.tokens) - seq.computed, budget)
            if not self._grow(seq, seq.computed + n):
                preempted = True
                if seq.phase is not Phase.RUNNING:
                    break  # it preempted itself: nothing after it runs either
            if seq.phase is Phase.RUNNING:
                items.append((seq, n))
                budget -= n
                i += 1
        return preempted

    def _grow(self, seq: Seq, tokens: int) -> bool:
        """Give ``seq`` blocks for ``tokens`` tokens, preempting from the end of the running
        list while none are free; False when something was preempted."""
        need = self._blocks_for(tokens) - len(seq.blocks)
        clean = True
        while need > 0:
            new = self.pool.allocate(need)
            if new is not None:
                seq.blocks += new
                return clean
            clean = False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return clean

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.pool.free(seq.blocks)
        seq.blocks, seq.computed, seq.cached_blocks = [], 0, 0
        seq.phase = Phase.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _schedule_waiting(self, items: list[tuple[Seq, int]], budget: int) -> None:
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            if seq.role == "decode" and not seq.kv_loaded:
                if not self._register(seq):
                    return
                continue
            if seq.kv_loaded and seq.blocks:  # a D leg whose KV came: its blocks are filled
                if budget <= 0:
                    return
                self._resume(seq, items)
                budget -= 1
                continue
            if budget <= 0 or not self._start(seq, items, budget):
                return
            budget -= items[-1][1]

    def _register(self, seq: Seq) -> bool:
        blocks = self.pool.allocate(self._blocks_for(seq.prompt_len))
        if blocks is None:
            return False
        self.waiting.popleft()
        seq.blocks = blocks
        seq.phase = Phase.REMOTE_KV
        self.awaiting_kv.add(seq)
        self.registered.append(seq)
        return True

    def _start(self, seq: Seq, items: list[tuple[Seq, int]], budget: int) -> bool:
        """Start the waiting queue's head with its prefix-cache hit and a first chunk."""
        size = self.pool.block_size
        lookup = len(seq.tokens) - 1  # the last token is always computed (its logits are needed)
        self._extend_hashes(seq, lookup)
        hit = self.pool.longest_prefix(seq.hashes[: lookup // size])
        computed = len(hit) * size
        n = min(len(seq.tokens) - computed, budget)
        need = self._blocks_for(computed + n) - len(hit)
        if need > self.pool.free_blocks_besides(hit):
            return False  # allocating would evict the hit it is about to use
        self.pool.take(hit)
        new = self.pool.allocate(need)
        assert new is not None  # counted above
        if seq.preemptions == 0:
            self.pool.count_lookup(seq.prompt_len, computed)
            seq.prefix_hit_tokens = computed
        self.waiting.popleft()
        seq.blocks = hit + new
        seq.computed = computed
        seq.cached_blocks = len(hit)
        seq.phase = Phase.RUNNING
        self.running.append(seq)
        items.append((seq, n))
        return True

    def _resume(self, seq: Seq, items: list[tuple[Seq, int]]) -> None:
        self.waiting.popleft()
        seq.phase = Phase.RUNNING
        self.running.append(seq)
        items.append((seq, len(seq.tokens) - seq.computed))

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def _extend_hashes(self, seq: Seq, tokens: int) -> None:
        size = self.pool.block_size
        have = len(seq.hashes)
        full = tokens // size
        if full > have:
            parent = seq.hashes[-1] if have else None
            seq.hashes += block_hashes(seq.tokens[have * size : full * size], size, parent)

    def finish(self, step: Step) -> list[Seq]:
        """Apply ``step``: advance each request, cache its newly full blocks, and return the
        requests that produced a token (in order). Requests aborted meanwhile are skipped."""
        produced = []
        for seq, n in step.items:
            if seq.phase is not Phase.RUNNING:
                continue
            seq.computed += n
            self._cache(seq)
            if seq.computed == len(seq.tokens):
                seq.tokens.append(GENERATED_TOKEN_ID + seq.generated)
                seq.generated += 1
                produced.append(seq)
                if seq.generated >= seq.max_tokens:
                    self._complete(seq)
        return produced

    def _cache(self, seq: Seq) -> None:
        self._extend_hashes(seq, seq.computed)
        full = seq.computed // self.pool.block_size
        if full > seq.cached_blocks:
            self.pool.cache(seq.blocks, seq.hashes[:full], seq.tokens, seq.cached_blocks)
            seq.cached_blocks = full

    def _complete(self, seq: Seq) -> None:
        self.running.remove(seq)
        if seq.role == "prefill":
            seq.phase = Phase.HELD
        else:
            self._end(seq)

    def drain_registered(self) -> list[Seq]:
        """D legs that allocated their blocks since the last call."""
        out, self.registered = self.registered, []
        return out


def _step(items: list[tuple[Seq, int]]) -> Step:
    context = pairs = 0
    for seq, n in items:
        if n == 1 and seq.computed > 0:
            context += seq.computed
        else:
            pairs += n * seq.computed + n * (n + 1) // 2
    return Step(tuple(items), sum(n for _, n in items), context, pairs)
