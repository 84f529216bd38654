"""An instance's load as vLLM reports it (its Prometheus ``/metrics``) and as policies compare it.

Who calls it: the scraper (:mod:`disagg_router.router.health.load_signals`) parses each page with
:func:`parse_signals`; the ``power_of_two`` policy compares instances with :func:`backend_load`;
the binding (:mod:`disagg_router.router.dispatch.binding`) weighs the :func:`fresh_signals` of
the Ds. Pure functions: no I/O, nothing raised into a request.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from disagg_router.router.instances.state import BackendState, LoadSignals

_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_KV_USAGE = "vllm:kv_cache_usage_perc"
_CACHE_INFO = "vllm:cache_config_info"


def parse_signals(text: str, model: str, at: float) -> LoadSignals | None:
    """The signals for ``model`` in a vLLM ``/metrics`` page (summed over its engines).

    Samples whose ``model_name`` label differs from ``model`` are ignored (when ``model`` is
    empty, all count). None when the page has neither request gauge or does not parse. The KV
    cache's size in tokens comes from ``vllm:cache_config_info`` (:func:`_kv_tokens`; 0 when
    the page does not say it).
    """
    sums = {_WAITING: 0.0, _RUNNING: 0.0, _KV_USAGE: 0.0}
    seen: set[str] = set()
    kv_tokens = 0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if model and sample.labels.get("model_name", model) != model:
                    continue
                if sample.name == _CACHE_INFO:
                    kv_tokens += _kv_tokens(sample.labels)
                if sample.name not in sums:
                    continue
                sums[sample.name] += sample.value
                seen.add(sample.name)
    except ValueError:
        return None
    if _WAITING not in seen and _RUNNING not in seen:
        return None
    usage = min(sums[_KV_USAGE], 1.0)
    return LoadSignals(sums[_WAITING], sums[_RUNNING], usage, at, kv_tokens=kv_tokens)


def _kv_tokens(labels: dict[str, str]) -> int:
    """One engine's KV cache in tokens from its ``cache_config_info`` labels:
    ``kv_cache_size_tokens`` (vLLM 0.32), else ``num_gpu_blocks`` times ``block_size``; 0 when
    neither is a positive integer."""
    size = _positive(labels.get("kv_cache_size_tokens"))
    if size:
        return size
    return _positive(labels.get("num_gpu_blocks")) * _positive(labels.get("block_size"))


def _positive(value: str | None) -> int:
    try:
        number = int(value or "")
    except ValueError:
        return 0
    return max(number, 0)


def backend_load(backend: BackendState, now: float, stale_after: float) -> float:
    """The load ``power_of_two`` compares: this router's legs in flight now, plus the requests
    vLLM reported beyond this router's own at the last scrape, plus KV cache usage.

    With fresh signals: ``in_flight + max(0, running + waiting - own_in_flight_at_scrape) +
    kv_usage``. The middle term is the load other routers (or clients) put on the instance; this
    router's own share is always the live count, never a stale one, so choices do not herd onto
    one instance between two scrapes. KV usage (0..1) breaks ties toward the emptier cache.
    Stale (older than ``stale_after``) or missing signals: ``in_flight`` alone.
    """
    s = fresh_signals(backend, now, stale_after)
    if s is None:
        return float(backend.in_flight)
    others = max(0.0, s.running + s.waiting - s.own_in_flight)
    return backend.in_flight + others + s.kv_usage


def fresh_signals(backend: BackendState, now: float, stale_after: float) -> LoadSignals | None:
    """``backend``'s last scraped signals, None when there are none or they are older than
    ``stale_after`` seconds at ``now``."""
    s = backend.signals
    return None if s is None or now - s.at > stale_after else s
