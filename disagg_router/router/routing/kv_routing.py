"""KV-aware routing state of the served models: tokenizers, KV indexes, event streams.

Who calls it: :mod:`disagg_router.router.runtime` holds the one :class:`KvRouting` (``Runtime.kv``).
The app's lifespan runs :meth:`KvRouting.run` as one supervised background task; the orchestrator
asks it once per request for the request's view of the model's index (``request``: a ``KvRequest``),
read by the ``kv_aware`` policy and the cached D-only rule.

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
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import zmq.asyncio

from disagg_router.router.config import InstanceConfig, KvEventsConfig
from disagg_router.router.observability.metrics import KvMetrics
from disagg_router.router.routing.block_keys import PromptTokenizer, load_tokenizer
from disagg_router.router.routing.kv_events import (
    EventStream,
    StreamLimits,
    StreamTarget,
    StreamTiming,
)
from disagg_router.router.routing.kv_index import KvIndex
from disagg_router.router.routing.kv_model import KvModel, KvRequest
from disagg_router.router.routing.table import LiveRouting

log = logging.getLogger(__name__)

RECONCILE_INTERVAL = 1.0
TOKENIZER_RETRY = 30.0


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

    async def run(self, routing: LiveRouting, metrics: KvMetrics) -> None:
        """Reconcile with ``routing``'s table in force until cancelled; then stop every stream.
        The lifespan runs it as one supervised background task."""
        ctx = zmq.asyncio.Context()
        try:
            while True:
                self.reconcile(routing, metrics, ctx)
                await asyncio.sleep(RECONCILE_INTERVAL)
        finally:
            for model in list(self.models.values()):
                await self._stop_model(model)
            self.models.clear()
            ctx.destroy(linger=0)

    def reconcile(self, routing: LiveRouting, metrics: KvMetrics, ctx: zmq.asyncio.Context) -> None:
        """Make models, tokenizers and streams match the routing table in force (no await)."""
        wanted = {
            name: found
            for name, found in routing.table.models.items()
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
                existing = self.models[name] = KvModel(name, config, metrics, index)
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
