"""Prometheus metrics of one router app, created once against a registry passed in.

Who calls it: :class:`disagg_router.router.runtime.Runtime` builds one :class:`RouterMetrics` per
app run (so tests can run several apps in one process); the dispatch and health monitor record into
it; ``/metrics`` renders the registry. :mod:`disagg_router.router.workers` names the shared
directory of ``serve --workers N`` (:data:`MULTIPROC_ENV`). Nothing here is module-global.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from disagg_router.router.observability.tenant_metrics import TenantMetrics
from disagg_router.router.observability.timeline import STAGES

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


# Stages range from tens of microseconds (the router's own) to seconds (a long prefill).
_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, *_LATENCY_BUCKETS)


# A whole answer: up to ``timeouts.total`` (default 600 s).
_REQUEST_BUCKETS = (*_LATENCY_BUCKETS, 300.0, 600.0)

# Time per output token: from sub-millisecond (tiny models) to a slow, overloaded decode.
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Where the workers of ``serve --workers N`` share their metric values (prometheus_client's
multiprocess mode, chosen by this variable when prometheus_client is imported): set by the
supervisor (:mod:`disagg_router.router.workers`) before any worker starts, unset for a single
process."""

M = TypeVar("M", bound=MetricWrapperBase)


class Instance(Protocol):
    """What :meth:`RouterMetrics.render` needs of a current instance (a ``BackendState``)."""

    @property
    def role(self) -> str: ...

    @property
    def label(self) -> str: ...


class RouterMetrics:
    """All router metrics; names are prefixed ``disagg_router_``, beside the process's own
    ``process_*`` (CPU seconds, resident memory, open file descriptors, start time).

    Record through :meth:`child` on the request path: it keeps each labelled series once found
    (``labels()`` validates and locks on every call, a few per cent of a loaded router's CPU).

    Several workers (:data:`MULTIPROC_ENV` set): values live in shared files and :meth:`render`
    sums them as each gauge's ``multiprocess_mode`` says (docs/router.md, "Several workers").
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.shared_dir = os.environ.get(MULTIPROC_ENV) or None
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        self._request_metrics()
        self._backend_metrics()
        self._router_metrics()
        self.answers = AnswerMetrics(registry)
        self.kv = KvMetrics(registry, shared=self.shared_dir is not None)
        self.passthrough = PassthroughMetrics(registry)
        self.tenants = TenantMetrics(registry)
        self.shared_names = {family.name for family in registry.collect()}  # not process_*
        ProcessCollector(registry=registry)

    def _request_metrics(self) -> None:
        """Per client request: outcomes, TTFT and its stages, retries, routes, stalls."""
        self.stale_retries = Counter(
            "disagg_router_upstream_stale_connection_retries",
            "Leg requests sent again on a new connection because the kept-alive one they were "
            "written on closed before a byte of the answer (the idle-close race)",
            registry=self.registry,
        )
        self.requests = Counter(
            "disagg_router_requests",
            "Client generation requests by mode, endpoint, model and outcome",
            ["mode", "endpoint", "model", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "disagg_router_ttft_seconds",
            "Router-observed time to first token: request accepted to D's first token in hand "
            "(stream=false: D's whole answer, which vLLM sends with its headers)",
            ["mode", "model", "stream"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft_stage = Histogram(
            "disagg_router_ttft_stage_seconds",
            "Router-observed time to first token by stage "
            "(disagg_router/router/observability/timeline.py): " + ", ".join(STAGES),
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "disagg_router_retries",
            "Dispatches retried on a fresh P/D pair",
            registry=self.registry,
        )
        self.decode_failovers = Counter(
            "disagg_router_decode_failovers",
            "Dispatches whose D died or hung, retried on another D: by phase (before_first_token, "
            "after_first_token: a stream migrated) and by whether the retry kept the attempt's P "
            "(kept) or took another (other)",
            ["phase", "prefill"],
            registry=self.registry,
        )
        self.failover_prefill_tokens = Histogram(
            "disagg_router_failover_prefill_computed_tokens",
            "Prompt tokens P computed (not served from its prefix cache) for an attempt that "
            "follows a D failure, by phase (before_first_token: a retry; after_first_token: a "
            "migrated stream's continuation)",
            ["phase"],
            buckets=(0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536),
            registry=self.registry,
        )
        self.binds = Counter(
            "disagg_router_decode_binds",
            "Push dispatches by when D was chosen and its leg sent (push.bind): eager (with P, "
            "at once), predicted (just in time: P's predicted finish less D's lead), "
            "prefill_done (P finished first), unlearned (P's speed not learned yet: at once)",
            ["reason"],
            registry=self.registry,
        )
        self.bind_delay = Histogram(
            "disagg_router_bind_delay_seconds",
            "Push dispatches: attempt start to D's leg sent (0 for eager binding), by bind "
            "(eager, just_in_time)",
            ["bind"],
            buckets=(0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=self.registry,
        )
        self.prefill_finish_error = Histogram(
            "disagg_router_prefill_finish_error_seconds",
            "How far P's answer came from the finish predicted when its prefill was sent (the "
            "prediction late binding uses), by direction (early: before the prediction, so P "
            "may wait for D; late: after it)",
            ["direction"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.migrations = Counter(
            "disagg_router_stream_migrations",
            "Streams whose D failed after the first token, by outcome: resumed (another D goes "
            "on), failed (no other D answered), refused (not continuable: token ids unknown, a "
            "tool call begun, the migration bound or the deadline reached)",
            ["outcome"],
            registry=self.registry,
        )
        self.routing_decisions = Counter(
            "disagg_router_routing_decisions",
            "Requests by model and route: disaggregated, or decode_only_short_prompt / "
            "decode_only_cached / "
            "decode_only_no_prefill (served by D alone)",
            ["model", "decision"],
            registry=self.registry,
        )
        self.stream_stalls = Counter(
            "disagg_router_stream_stalls",
            "Streams ended because D sent nothing for timeouts.inter_token after the first token",
            registry=self.registry,
        )
        self.relay_spliced_reads = Counter(
            "disagg_router_relay_spliced_reads",
            "Reads of D's stream written to the client from the socket's callback, no task woken",
            registry=self.registry,
        )

    def _backend_metrics(self) -> None:
        """Per instance (``backend`` label; :meth:`per_backend` lists them): legs, health,
        identity, breaker, admission."""
        self.prefill_duration = Histogram(
            "disagg_router_prefill_leg_seconds",
            "Duration of the prefill leg by backend and outcome",
            ["backend", "outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decode_first_token = Histogram(
            "disagg_router_decode_first_token_seconds",
            "Time from dispatch of the decode leg to its first token (or whole answer)",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "disagg_router_backend_in_flight",
            "Legs currently in flight per backend",
            ["role", "backend"],
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.healthy = Gauge(
            "disagg_router_backend_healthy",
            "1 if the backend passed its last health check",
            ["role", "backend"],
            multiprocess_mode="livemostrecent",
            registry=self.registry,
        )
        self.identity_changes = Counter(
            "disagg_router_identity_changes",
            "Prefill identities learned or changed (identity probes and P legs)",
            ["backend"],
            registry=self.registry,
        )
        self.breaker_open = Gauge(
            "disagg_router_backend_breaker_open",
            "1 while the backend's circuit breaker keeps it out of rotation",
            ["role", "backend"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.admission_queue = Gauge(
            "disagg_router_admission_queue_length",
            "Legs waiting for an admission slot on the backend",
            ["role", "backend"],
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.admission_wait = Histogram(
            "disagg_router_admission_wait_seconds",
            "Time a leg waited for an admission slot",
            ["role"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.admission_rejected = Counter(
            "disagg_router_admission_rejected",
            "Legs refused admission (queue full or wait too long)",
            ["role", "backend"],
            registry=self.registry,
        )
        self.breaker_probes = Counter(
            "disagg_router_breaker_probes",
            "Half-open probes of an open breaker by outcome",
            ["role", "backend", "outcome"],
            registry=self.registry,
        )

    def _router_metrics(self) -> None:
        """The router's own state: discovery, config reloads, background tasks."""
        pool_source = ["pool", "source"]
        self.discovery_instances = Gauge(
            "disagg_router_discovery_instances",
            "Instances in the last known discovered set of a pool",
            pool_source,
            multiprocess_mode="livemostrecent",
            registry=self.registry,
        )
        self.discovery_ok = Gauge(
            "disagg_router_discovery_ok",
            "1 if the pool's last discovery attempt gave a usable set, 0 if it kept the last one",
            pool_source,
            multiprocess_mode="livemin",
            registry=self.registry,
        )
        self.discovery_failures = Counter(
            "disagg_router_discovery_failures",
            "Discovery attempts that failed or found nothing (the last known set was kept)",
            pool_source,
            registry=self.registry,
        )
        self.discovery_changes = Counter(
            "disagg_router_discovery_changes",
            "Times a pool's discovered set changed (instances joined or left)",
            pool_source,
            registry=self.registry,
        )
        self.refused_pairs = Gauge(
            "disagg_router_refused_pairs",
            "P/D pairs of a model whose learned shapes the KV connector cannot serve (skipped; "
            "/ready says why)",
            ["model"],
            registry=self.registry,
        )
        self.config_reloads = Counter(
            "disagg_router_config_reloads",
            "Config reloads by result: applied, or rejected (the previous config keeps serving)",
            ["result"],
            registry=self.registry,
        )
        self.background_crashes = Counter(
            "disagg_router_background_crashes",
            "Crashes of a supervised background task (each is logged and restarted)",
            ["task"],
            registry=self.registry,
        )

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, kept for the next call (the series stays the same object
        until :meth:`forget_backend` removes it)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found  # type: ignore[return-value]  # stored by the same metric's labels()

    def per_backend(self) -> list[tuple[MetricWrapperBase, tuple[str, ...]]]:
        """Every family labelled by instance, with its label names: :meth:`forget_backend`
        removes an instance's series from each (a family added with a ``backend`` label
        belongs here)."""
        rb = ("role", "backend")
        return [
            (self.prefill_duration, ("backend", "outcome")),
            (self.decode_first_token, ("backend",)),
            (self.in_flight, rb),
            (self.healthy, rb),
            (self.identity_changes, ("backend",)),
            (self.breaker_open, rb),
            (self.admission_queue, rb),
            (self.admission_rejected, rb),
            (self.breaker_probes, (*rb, "outcome")),
        ]

    def count_stale_retry(self, origin: tuple[str, int, bool]) -> None:
        """A request went out again after the idle-close race
        (:mod:`disagg_router.router.upstream.h1`)."""
        self.stale_retries.inc()

    def set_breaker_open(self, role: str, label: str, is_open: bool) -> None:
        """The breaker gauge of one instance (called whenever its breaker opens or closes)."""
        self.child(self.breaker_open, role, label).set(1 if is_open else 0)

    def forget_backend(self, role: str, label: str, label_in_use: bool = False) -> None:
        """Drop every series of an instance that left (every pool, its last leg ended).

        Families without a ``role`` label are keyed by ``label`` alone: kept when
        ``label_in_use`` (an instance of the other role has the same label). Several workers:
        shared values cannot be removed; :meth:`render` leaves out instances no longer current.
        """
        if self.shared_dir is not None:
            return
        for metric, names in self.per_backend():
            if "role" not in names and label_in_use:
                continue
            for values in _label_sets(metric, names):
                found = dict(zip(names, values, strict=True))
                if found["backend"] != label or found.get("role", role) != role:
                    continue
                with contextlib.suppress(KeyError):
                    metric.remove(*values)
                self._children.pop((id(metric), values), None)

    def render(self, current: Iterable[Instance] = ()) -> bytes:
        """The text exposition of ``/metrics``. Several workers: every worker's series summed
        (per gauge as its ``multiprocess_mode`` says), without the series of instances not in
        ``current`` (the answering worker's instances); beside them the answering worker's own
        collectors (``process_*``, the readiness gauges)."""
        if self.shared_dir is None:
            return generate_latest(self.registry)
        return generate_latest(_WorkersView(self, self.shared_dir, current))


class AnswerMetrics:
    """Per answered request (outcome ``ok``), recorded once at its end by :meth:`observe`:
    end-to-end latency, time per output token, prompt and completion tokens, by model."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.request_duration = Histogram(
            "disagg_router_request_duration_seconds",
            "End-to-end latency of answered requests: accepted to the answer's last chunk ready "
            "for the client",
            ["model", "stream"],
            buckets=_REQUEST_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "disagg_router_time_per_output_token_seconds",
            "Streamed answers: (end-to-end - TTFT) / (completion_tokens - 1), from the usage "
            "the client gets (stream_options.include_usage)",
            ["model"],
            buckets=_TPOT_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "disagg_router_prompt_tokens",
            "Prompt tokens of answered requests, from the usage the client gets",
            ["model"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            "disagg_router_completion_tokens",
            "Completion tokens of answered requests, from the usage the client gets",
            ["model"],
            registry=registry,
        )
        self._series: dict[tuple[str, bool], _AnswerSeries] = {}

    def observe(self, model: str, stream: bool, ttft: float, e2e: float, usage: Any) -> None:
        """Record one answered request at its end (the HTTP layer, once per request; never per
        token). ``ttft``, ``e2e``: seconds since accepted; ``usage``: the client's usage object
        (None when a stream did not ask for it: then no tokens and no TPOT)."""
        series = self._series.get((model, stream)) or self._new_series(model, stream)
        series.duration.observe(e2e)
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and prompt > 0:
            series.prompt.inc(prompt)
        if not isinstance(completion, int) or completion <= 0:
            return
        series.completion.inc(completion)
        if stream and completion > 1:
            series.tpot.observe(max(e2e - ttft, 0.0) / (completion - 1))

    def _new_series(self, model: str, stream: bool) -> _AnswerSeries:
        """The series of ``model`` (a configured model: bounded), kept for the next request."""
        series = self._series[(model, stream)] = _AnswerSeries(
            self.request_duration.labels(model, "true" if stream else "false"),
            self.tpot.labels(model),
            self.prompt_tokens.labels(model),
            self.completion_tokens.labels(model),
        )
        return series


@dataclass(frozen=True)
class _AnswerSeries:
    """The labelled series one (model, stream) records into."""

    duration: Histogram
    tpot: Histogram
    prompt: Counter
    completion: Counter


def _label_sets(metric: MetricWrapperBase, names: tuple[str, ...]) -> set[tuple[str, ...]]:
    """The label values of every series of ``metric`` (read through ``collect()``)."""
    out: set[tuple[str, ...]] = set()
    for family in metric.collect():
        for sample in family.samples:
            if all(n in sample.labels for n in names):
                out.add(tuple(sample.labels[n] for n in names))
    return out


class _WorkersView:
    """What ``/metrics`` shows with several workers: every worker's values of the shared
    families (prometheus_client's :class:`MultiProcessCollector`) less the series of instances
    not in ``current``, then the answering worker's own families (``process_*``, readiness)."""

    def __init__(self, metrics: RouterMetrics, path: str, current: Iterable[Instance]) -> None:
        self._metrics = metrics
        self._path = path
        self._keep = {(b.role, b.label) for b in current}
        self._labels = {label for _, label in self._keep}
        per_instance = metrics.per_backend()
        self._by_instance = {f.name for m, _ in per_instance for f in m.describe()}

    def _kept(self, labels: dict[str, str]) -> bool:
        if "role" in labels:
            return (labels["role"], labels.get("backend", "")) in self._keep
        return labels.get("backend") in self._labels

    def collect(self) -> Iterator[Metric]:
        workers = MultiProcessCollector(None, self._path)  # type: ignore[no-untyped-call]
        for family in workers.collect():  # type: ignore[no-untyped-call]
            if family.name in self._by_instance:
                family.samples = [s for s in family.samples if self._kept(s.labels)]
            yield family
        shared = self._metrics.shared_names
        yield from (f for f in self._metrics.registry.collect() if f.name not in shared)


class KvTarget(Protocol):
    """What a KV metric is labelled with: the model and the instance's label."""

    @property
    def model(self) -> str: ...

    @property
    def label(self) -> str: ...


class KvApplied(Protocol):
    """What one applied event batch did
    (:class:`disagg_router.router.routing.kv_index.ApplyResult`)."""

    @property
    def stored(self) -> int: ...

    @property
    def removed(self) -> int: ...

    @property
    def skipped(self) -> int: ...


class KvMetrics:
    """The KV-aware routing metrics (``disagg_router_kv_*``): the index's size and freshness per
    instance, resyncs and stream failures, and per routing decision the cached tokens the index
    predicted on the chosen instance beside the prompt's tokens (compare with vLLM's
    ``vllm:prompt_tokens_by_source_total``)."""

    def __init__(self, registry: CollectorRegistry, shared: bool = False) -> None:
        self._shared = shared
        instance = ["model", "instance"]
        self.index_blocks = Gauge(
            "disagg_router_kv_index_blocks",
            "Blocks the router's KV index holds for the instance",
            instance,
            multiprocess_mode="livemostrecent",
            registry=registry,
        )
        self.event_lag = Histogram(
            "disagg_router_kv_event_lag_seconds",
            "Time from vLLM publishing a KV event batch to the router applying it",
            ["model"],
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )
        self.events = Counter(
            "disagg_router_kv_blocks_events",
            "Blocks in applied KV events by kind: stored, removed, skipped (not indexable)",
            ["model", "instance", "kind"],
            registry=registry,
        )
        self.bad_events = Counter(
            "disagg_router_kv_bad_events",
            "KV event messages and events skipped, by reason: frames, sequence, too_large, "
            "undecodable (whole messages); invalid, unknown_type, too_many_blocks (one event)",
            ["model", "instance", "reason"],
            registry=registry,
        )
        self.resyncs = Counter(
            "disagg_router_kv_resyncs",
            "Index resyncs of an instance by reason: join, gap, gap_unfilled, restart, "
            "replay_incomplete, resubscribe (ZMQ dropped the event connection)",
            ["model", "instance", "reason"],
            registry=registry,
        )
        self.degraded = Gauge(
            "disagg_router_kv_stream_degraded",
            "1 while the instance's KV event stream does not answer (approximate routing)",
            instance,
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.stream_failures = Counter(
            "disagg_router_kv_stream_failures",
            "KV event subscriber tasks that failed and were restarted",
            instance,
            registry=registry,
        )
        self.predicted_tokens = Counter(
            "disagg_router_kv_predicted_cached_tokens",
            "Prompt tokens the index predicted cached on the chosen instance, per decision",
            ["model", "role"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "disagg_router_kv_prompt_tokens",
            "Prompt tokens of the requests the kv_aware policy routed by the index",
            ["model", "role"],
            registry=registry,
        )
        self.tokenize_seconds = Histogram(
            "disagg_router_kv_tokenize_seconds",
            "Time to compute one request's block keys (chat template, tokenizer, hashing)",
            ["model"],
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )

    def observe_lag(self, target: KvTarget, seconds: float) -> None:
        self.event_lag.labels(target.model).observe(seconds)

    def record_apply(self, target: KvTarget, result: KvApplied, blocks: int) -> None:
        """Count one applied batch and set the instance's index size."""
        for kind, count in (
            ("stored", result.stored),
            ("removed", result.removed),
            ("skipped", result.skipped),
        ):
            if count:
                self.events.labels(target.model, target.label, kind).inc(count)
        self.index_blocks.labels(target.model, target.label).set(blocks)

    def count_bad(self, target: KvTarget, reason: str) -> None:
        """Count one skipped message or event (``reason``: see ``bad_events``)."""
        self.bad_events.labels(target.model, target.label, reason).inc()

    def count_resync(self, target: KvTarget, reason: str) -> None:
        self.resyncs.labels(target.model, target.label, reason).inc()

    def set_degraded(self, target: KvTarget, degraded: bool) -> None:
        self.degraded.labels(target.model, target.label).set(1 if degraded else 0)

    def forget(self, target: KvTarget) -> None:
        """Drop the per-instance gauges of an instance no longer followed (several workers:
        set them to 0, shared values cannot be removed)."""
        for gauge in (self.index_blocks, self.degraded):
            if self._shared:
                gauge.labels(target.model, target.label).set(0)
                continue
            with contextlib.suppress(KeyError):
                gauge.remove(target.model, target.label)


class PassthroughMetrics:
    """The routes beside generation (``/tokenize``, ``/v1/embeddings``, ``/v1/responses``,
    ...; :mod:`disagg_router.router.http.passthrough`): requests by route and outcome, and their
    duration."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "disagg_router_passthrough_requests",
            "Requests to the routes forwarded to one instance, by route and outcome",
            ["route", "outcome"],
            registry=registry,
        )
        self.seconds = Histogram(
            "disagg_router_passthrough_seconds",
            "Duration of a forwarded request, accepted to the end of its answer, by route",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
