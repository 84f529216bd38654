"""KV-aware routing state of the served models: tokenizers, KV indexes, event streams.

Who calls it: :mod:`router.http.app`'s lifespan runs :func:`run_kv_routing` as one supervised
background task; :mod:`router.runtime` holds the one :class:`KvRouting` (``Runtime.kv``), which
the orchestrator asks once per request for a :class:`KvRequest` (``request``), read by the
``kv_aware`` policy and the cached D-only rule.

:meth:`KvRouting.run` reconciles every ``RECONCILE_INTERVAL`` seconds with the routing table in
force, so it follows discovery (instances that join get a stream, those that leave lose theirs
and their index entries) and hot reload (a model whose ``kv_events`` changed starts over) with
no hook in either. A stream task that fails (a ZMQ error: nothing a publisher sends makes it
fail) is logged, counted (``disagg_router_kv_stream_failures_total``), its index entries
dropped, and restarted at the next reconcile as a stream that starts ``degraded`` with the
failure as its reason. :meth:`KvRouting.degraded` lists the degraded streams for ``/ready``,
from the same state the ``disagg_router_kv_stream_degraded`` gauge follows. A tokenizer that
cannot be loaded is logged and retried after ``TOKENIZER_RETRY`` seconds; until it loads, the
model routes approximately.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import zmq.asyncio

from router.config import InstanceConfig, KvEventsConfig
from router.observability.metrics import KvMetrics
from router.routing.backends import BackendState
from router.routing.block_keys import PromptTokenizer, load_tokenizer, request_keys
from router.routing.kv_events import EventStream, StreamLimits, StreamTarget, StreamTiming
from router.routing.kv_index import KvIndex

if TYPE_CHECKING:
    from router.runtime import Runtime

log = logging.getLogger(__name__)

RECONCILE_INTERVAL = 1.0
TOKENIZER_RETRY = 30.0
_RECENT_LEGS = 64


def stream_target(model: str, instance: InstanceConfig, config: KvEventsConfig) -> StreamTarget:
    """Where ``instance`` publishes: its own endpoints, else its URL's host and the ports."""
    host = urlsplit(instance.url).hostname or ""
    host = f"[{host}]" if ":" in host else host
    return StreamTarget(
        model=model,
        label=instance.label,
        endpoint=instance.kv_events_endpoint or f"tcp://{host}:{config.events_port}",
        replay_endpoint=instance.kv_replay_endpoint or f"tcp://{host}:{config.replay_port}",
        topic=config.topic,
    )


@dataclass
class KvModel:
    """One model's KV-aware state: config, tokenizer (None until loaded), index, streams."""

    name: str
    config: KvEventsConfig
    metrics: KvMetrics
    index: KvIndex
    tokenizer: PromptTokenizer | None = None
    streams: dict[str, EventStream] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    recent: dict[str, deque[int]] = field(default_factory=dict)
    tokenizer_failed_at: float | None = None
    loading: asyncio.Task[PromptTokenizer] | None = None

    def routable(self, label: str) -> bool:
        stream = self.streams.get(label)
        return stream is not None and stream.routable

    def status(self) -> dict[str, Any]:
        """The ``/ready`` view: per instance its stream state (and why not live), blocks."""
        return {
            "tokenizer": "loaded" if self.tokenizer is not None else "not loaded",
            "instances": {
                label: {
                    "state": s.state,
                    "blocks": self.index.blocks(label),
                    **({"reason": s.reason} if s.reason else {}),
                }
                for label, s in self.streams.items()
            },
        }


class KvRequest:
    """One request as the KV index sees it; block keys computed once, on first use."""

    def __init__(self, model: KvModel, body: Mapping[str, Any], chat: bool) -> None:
        self._model = model
        self._body = body
        self._chat = chat
        self._keys: tuple[int, list[bytes]] | None = None
        self._computed = False

    def _request_keys(self) -> tuple[int, list[bytes]] | None:
        if not self._computed:
            self._computed = True
            tokenizer, block_size = self._model.tokenizer, self._model.index.block_size
            if tokenizer is not None and block_size is not None:
                started = time.perf_counter()
                self._keys = request_keys(tokenizer, self._body, self._chat, block_size)
                elapsed = time.perf_counter() - started
                self._model.metrics.tokenize_seconds.labels(self._model.name).observe(elapsed)
        return self._keys

    @property
    def prompt_tokens(self) -> int:
        found = self._request_keys()
        return found[0] if found else 0

    @property
    def tie_key(self) -> bytes:
        """The request's first block key: equal for prompts sharing their first block."""
        found = self._request_keys()
        return found[1][0] if found and found[1] else b""

    def matched(self, candidates: Sequence[BackendState]) -> dict[str, int] | None:
        """Cached prompt tokens per candidate label, or None when the index cannot answer for
        all of them (no keys for this request, or a candidate's stream is not live)."""
        found = self._request_keys()
        if not found or not found[1] or self._model.index.block_size is None:
            return None
        if not all(self._model.routable(c.label) for c in candidates):
            return None
        size = self._model.index.block_size
        return {
            c.label: size * self._model.index.matched_blocks(c.label, found[1]) for c in candidates
        }

    def decode_holds(self, candidates: Sequence[BackendState]) -> bool:
        """Whether a candidate D holds ``decode_only_fraction`` of the prompt (never when the
        fraction is 0 or the index cannot answer)."""
        fraction = self._model.config.decode_only_fraction
        if fraction <= 0 or not candidates:
            return False
        matched = self.matched(candidates)
        total = self.prompt_tokens
        return bool(matched and total and max(matched.values()) >= fraction * total)

    def queued(self, backend: BackendState) -> int:
        """Prefill tokens this router sent to ``backend`` and not yet done, estimated as the
        uncached tokens of its latest ``in_flight`` legs."""
        recent = self._model.recent.get(backend.label)
        if not recent or backend.in_flight <= 0:
            return 0
        return sum(list(recent)[-backend.in_flight :])

    def chose(self, backend: BackendState, matched: int) -> None:
        """Record a decision: its predicted cached tokens, and the work it queues there."""
        metrics, model, role = self._model.metrics, self._model.name, backend.role
        metrics.predicted_tokens.labels(model, role).inc(matched)
        metrics.prompt_tokens.labels(model, role).inc(self.prompt_tokens)
        recent = self._model.recent.setdefault(backend.label, deque(maxlen=_RECENT_LEGS))
        recent.append(max(0, self.prompt_tokens - matched))


class KvRouting:
    """The KV-aware state of every model with ``kv_events`` enabled; see the module docstring."""

    def __init__(self) -> None:
        self.models: dict[str, KvModel] = {}
        self._stopping: set[asyncio.Future[None]] = set()

    def request(self, model: str, body: Mapping[str, Any], chat: bool) -> KvRequest | None:
        """The request's view of ``model``'s index; None when the model has no KV routing."""
        found = self.models.get(model)
        return KvRequest(found, body, chat) if found is not None else None

    def status(self) -> dict[str, Any]:
        """Per model, the tokenizer and each instance's stream state (the ``/ready`` body)."""
        return {name: m.status() for name, m in self.models.items()}

    async def run(self, runtime: Runtime) -> None:
        """Reconcile with the routing table until cancelled; then stop every stream."""
        ctx = zmq.asyncio.Context()
        try:
            while True:
                self.reconcile(runtime, ctx)
                await asyncio.sleep(RECONCILE_INTERVAL)
        finally:
            for model in list(self.models.values()):
                await self._stop_model(model)
            self.models.clear()
            ctx.destroy(linger=0)

    def reconcile(self, runtime: Runtime, ctx: zmq.asyncio.Context) -> None:
        """Make models, tokenizers and streams match the routing table in force (no await)."""
        wanted = {
            name: found
            for name, found in runtime.routing.table.models.items()
            if found.route.kv_events.enabled
        }
        for name in list(self.models):
            model = self.models[name]
            if name not in wanted or wanted[name].route.kv_events != model.config:
                self.models.pop(name)
                stopping = asyncio.ensure_future(self._stop_model(model))
                self._stopping.add(stopping)
                stopping.add_done_callback(self._stopping.discard)
        for name, found in wanted.items():
            config = found.route.kv_events
            existing = self.models.get(name)
            if existing is None:
                index = KvIndex(config.max_blocks_per_instance)
                existing = self.models[name] = KvModel(name, config, runtime.metrics.kv, index)
            model = existing
            self._tokenizer(model)
            backends = found.prefill.backends + found.decode.backends
            self._streams(model, {b.label: b.config for b in backends}, ctx)

    def _tokenizer(self, model: KvModel) -> None:
        if model.tokenizer is not None:
            return
        task = model.loading
        if task is not None and task.done():
            model.loading = None
            if task.exception() is None:
                model.tokenizer = task.result()
                log.info("kv routing %s: tokenizer loaded", model.name)
                return
            log.error("kv routing %s: tokenizer not loaded: %s", model.name, task.exception())
            model.tokenizer_failed_at = time.monotonic()
        failed = model.tokenizer_failed_at
        if model.loading is None and (
            failed is None or time.monotonic() - failed > TOKENIZER_RETRY
        ):
            model.loading = asyncio.ensure_future(
                asyncio.to_thread(_prompt_tokenizer, model.config)
            )

    def _streams(
        self, model: KvModel, members: dict[str, InstanceConfig], ctx: zmq.asyncio.Context
    ) -> None:
        for label in [label for label in model.streams if label not in members]:
            self._drop(model, label)
        for label, instance in members.items():
            task = model.tasks.get(label)
            target = stream_target(model.name, instance, model.config)
            stream = model.streams.get(label)
            if stream is not None and stream.target != target:
                self._drop(model, label)
                task = None
            failed = None
            if task is not None and task.done():
                failed = self._failed(model, label, task)
                task = None
            if task is None:
                stream = _stream(model, target, failed)
                model.streams[label] = stream
                model.tasks[label] = asyncio.ensure_future(stream.run(ctx))

    def _failed(self, model: KvModel, label: str, task: asyncio.Task[None]) -> str:
        """Count and log a finished stream task; returns why it stopped."""
        error = None if task.cancelled() else task.exception()
        log.error("kv events %s/%s: subscriber failed (%r); restarting", model.name, label, error)
        model.metrics.stream_failures.labels(model.name, label).inc()
        model.index.clear(label)
        return repr(error)[:200]

    def degraded(self) -> list[str]:
        """One line per degraded stream (model, instance, reason): ``/ready``'s entries."""
        return [
            f"kv events {name}/{label}: {stream.reason}"
            for name, model in self.models.items()
            for label, stream in model.streams.items()
            if stream.state == "degraded"
        ]

    def _drop(self, model: KvModel, label: str) -> None:
        task = model.tasks.pop(label, None)
        stream = model.streams.pop(label)
        if task is not None:
            task.cancel()
        model.index.clear(label)
        model.recent.pop(label, None)
        model.metrics.forget(stream.target)

    async def _stop_model(self, model: KvModel) -> None:
        tasks = list(model.tasks.values())
        for label in list(model.streams):
            self._drop(model, label)
        if model.loading is not None:
            model.loading.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _stream(model: KvModel, target: StreamTarget, failed: str | None) -> EventStream:
    config = model.config
    timing = StreamTiming(config.probe_interval, config.probe_timeout)
    limits = StreamLimits(config.max_message_bytes, config.max_blocks_per_event)
    return EventStream(target, model.index, timing, model.metrics, limits, failed=failed)


def _prompt_tokenizer(config: KvEventsConfig) -> PromptTokenizer:
    assert config.tokenizer is not None  # validated: enabled implies a tokenizer
    return PromptTokenizer(
        load_tokenizer(config.tokenizer), config.tokenize_cache_entries, config.max_prompt_chars
    )


async def run_kv_routing(runtime: Runtime) -> None:
    """The lifespan's background task: :meth:`KvRouting.run` of the runtime's ``kv``."""
    await runtime.kv.run(runtime)
