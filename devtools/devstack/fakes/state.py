"""State of one fake vLLM instance: behaviour knobs, token scripts, identity, recorded requests,
counters.

Who uses it: :mod:`devstack.fakes.vllm_app` (mutates it from the server's event loop thread) and
tests (read records, wait for counters, change behaviour while the server runs). All shared
mutation goes through the lock, so test threads and the server thread may use it concurrently.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from disagg_router.connector.contract import EngineShape


@dataclass(frozen=True)
class TokenScript:
    """Delays of one response: ``ttft_s`` before the first token, then ``gaps_s[i]`` before token
    ``i + 1`` (the last gap repeats if the response is longer than the script)."""

    ttft_s: float = 0.0
    gaps_s: tuple[float, ...] = ()

    def gap(self, index: int) -> float:
        """The delay between token ``index`` and token ``index + 1``."""
        if not self.gaps_s:
            return 0.0
        return self.gaps_s[min(index, len(self.gaps_s) - 1)]


@dataclass
class FakeBehavior:
    """Mutable knobs; tests change them between (or during) requests.

    ``fail_status``: answer every generation request with this HTTP error.
    ``hang``: never answer (until the client goes away or the cap passes).
    ``drop_after_tokens``: in a stream, cut the connection after this many tokens.
    ``stall_after_tokens``: in a stream, send this many tokens, then nothing more (the connection
    stays open until the client leaves or the hang cap passes).
    ``fail_times``: only the next N generation requests fail/hang/drop/stall (None: all of them).
    ``leg_fail_status``: answer every real P/D leg (a request carrying ``kv_transfer_params``
    that is not an identity probe) with this HTTP error, while ``/health``, identity probes and
    plain completions (the router's half-open probe of a D) pass: an instance that looks alive
    to every probe but fails the work (not limited by ``fail_times``).
    ``scripts``: when set, generation request ``k`` follows ``scripts[k % len(scripts)]`` instead
    of ``prefill_delay_s``/``token_delay_s`` (tokens on an absolute schedule: known timings).
    All delays zero (the default): no sleeping or polling at all.
    """

    prefill_delay_s: float = 0.0
    #: at most this many prefill delays run at once, the others queue (reported as waiting in
    #: ``/metrics``), like an engine whose prefill is compute bound; None: no limit
    prefill_slots: int | None = None
    token_delay_s: float = 0.0
    fail_status: int | None = None
    hang: bool = False
    drop_after_tokens: int | None = None
    stall_after_tokens: int | None = None
    fail_times: int | None = None
    leg_fail_status: int | None = None
    default_max_tokens: int = 16
    prompt_cached_tokens: int = 0
    kv_wait_timeout_s: float = 5.0
    answer_delay_s: float = 0.0  # non-stream: delay the HTTP answer after the KV is published
    scripts: tuple[TokenScript, ...] = ()


@dataclass
class PushIdentity:
    """What a prefill instance reports about itself in ``kv_transfer_params``."""

    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    host: str = "127.0.0.1"
    port: int = 5600
    tp_size: int = 1
    pp_size: int = 1


class KvFabric:
    """Links fakes the way NIXL push links P and D, for tests that share one fabric.

    A prefill fake publishes ``(its engine id, X-Request-Id)`` when it finishes a
    ``do_remote_decode`` request; a decode fake given ``do_remote_prefill`` produces no token until
    the P named by ``remote_engine_id`` published the same request id (or its
    ``kv_wait_timeout_s`` passes: then it fails like vLLM's registration watchdog). So a wrongly
    paired D fails, and D's first token never precedes P's answer.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: set[tuple[str, str]] = set()

    def publish(self, engine_id: str, request_id: str) -> None:
        with self._lock:
            self._done.add((engine_id, request_id))

    def is_done(self, engine_id: str, request_id: str) -> bool:
        with self._lock:
            return (engine_id, request_id) in self._done


@dataclass
class RecordedRequest:
    """One request as the fake received it; ``outcome`` is filled when it ends."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    received_at: float
    finished_at: float | None = None
    outcome: str = "in_flight"  # ok | cancelled | error | dropped | in_flight
    client_port: int | None = None  # the caller's TCP port: equal ports = a reused connection
    token_times: list[float] = field(default_factory=list)  # perf_counter() at each streamed token


def identity_copy(identity: PushIdentity) -> PushIdentity:
    return PushIdentity(
        identity.engine_id, identity.host, identity.port, identity.tp_size, identity.pp_size
    )


class FakeVllmState:
    """Shared, thread-safe state of one fake instance (records, counters, behaviour)."""

    def __init__(
        self,
        model: str = "fake-model",
        behavior: FakeBehavior | None = None,
        identity: PushIdentity | None = None,
        transfer_mode: str = "push",
        fabric: KvFabric | None = None,
        kv_connector: bool = True,
        prompt_tokens_details: bool = True,
        max_model_len: int = 4096,
        shape: EngineShape | None = None,
    ) -> None:
        """``shape``: the engine shape identity probes are answered, like our connector (P's
        answer carries it; a bare probe, D's, gets it alone); None: none, like a connector that
        does not speak shapes."""
        self.model = model
        self.max_model_len = max_model_len  # reported by /v1/models and /tokenize
        self.shape = self._initial_shape = shape
        self.fabric = fabric
        self.kv_connector = kv_connector  # False: like vLLM started without --kv-transfer-config
        # False: like vLLM started without --enable-prompt-tokens-details
        self.prompt_tokens_details = prompt_tokens_details
        self.behavior = behavior or FakeBehavior()
        self.identity = identity or PushIdentity()
        self.transfer_mode = transfer_mode
        self._initial = (
            transfer_mode,
            kv_connector,
            prompt_tokens_details,
            identity_copy(self.identity),
        )
        self._lock = threading.Lock()
        self.requests: list[RecordedRequest] = []
        self.in_flight = 0
        self.waiting = 0  # requests queued for a prefill slot
        self._gates: dict[int, asyncio.Semaphore] = {}
        self.cancelled = 0
        self.completed = 0
        self.health_checks = 0
        self._served = itertools.count()
        self._cond = threading.Condition(self._lock)

    def reset(self, behavior: FakeBehavior | None = None) -> None:
        """Forget records and counters; install ``behavior`` (default: a fresh one); restore the
        constructed transfer mode, connector flag, identity and shape."""
        with self._lock:
            self.shape = self._initial_shape
            self.transfer_mode, self.kv_connector, self.prompt_tokens_details, identity = (
                self._initial
            )
            self.identity = identity_copy(identity)
            self.requests.clear()
            self.cancelled = 0
            self.completed = 0
            self.health_checks = 0
            self._served = itertools.count()
            self.behavior = behavior or FakeBehavior()

    def record(self, rec: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(rec)

    def generation_requests(self) -> list[RecordedRequest]:
        """Recorded completion/chat requests (probes included), in arrival order."""
        with self._lock:
            return [r for r in self.requests if r.path.startswith("/v1/") and r.method == "POST"]

    def count_health_check(self) -> None:
        with self._cond:
            self.health_checks += 1
            self._cond.notify_all()

    def next_script(self) -> TokenScript | None:
        """The token script of the next generation request (``None``: the plain delays)."""
        with self._lock:
            scripts = self.behavior.scripts
            return scripts[next(self._served) % len(scripts)] if scripts else None

    def _take_failure(self) -> bool:
        with self._lock:
            b = self.behavior
            if b.fail_times is None:
                return True
            if b.fail_times <= 0:
                return False
            b.fail_times -= 1
            return True

    def prefill_gate(self, slots: int) -> asyncio.Semaphore:
        """The semaphore bounding concurrent prefills to ``slots`` (used on the app's loop)."""
        return self._gates.setdefault(slots, asyncio.Semaphore(slots))

    def queued(self, delta: int) -> None:
        """Count a request entering (+1) or leaving (-1) the prefill queue."""
        with self._lock:
            self.waiting += delta

    def _enter(self) -> None:
        with self._cond:
            self.in_flight += 1
            self._cond.notify_all()

    def _leave(self, rec: RecordedRequest, outcome: str) -> None:
        with self._cond:
            self.in_flight -= 1
            rec.outcome = outcome
            rec.finished_at = time.monotonic()
            if outcome == "cancelled":
                self.cancelled += 1
            elif outcome == "ok":
                self.completed += 1
            self._cond.notify_all()

    def wait_for(self, predicate: Any, timeout: float = 15.0) -> bool:
        """Block (test thread) until ``predicate(state)`` is true; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True
