"""One model's KV-aware state and one request's view of it.

Who calls it: :class:`disagg_router.router.routing.kv_routing.KvRouting` keeps one :class:`KvModel`
per model with ``kv_events`` (its index, tokenizer and streams); the orchestrator gets a
:class:`KvRequest` per request from it, read by the ``kv_aware`` policy and the cached D-only rule.
Event loop only; nothing here awaits or does I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg_router.router.config import KvEventsConfig
from disagg_router.router.instances.state import BackendState
from disagg_router.router.observability.metrics import KvMetrics
from disagg_router.router.routing.block_keys import PromptTokenizer, request_keys
from disagg_router.router.routing.kv_events import EventStream
from disagg_router.router.routing.kv_index import KvIndex

_RECENT_LEGS = 64


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
