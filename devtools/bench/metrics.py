"""Per-request records and aggregate metrics with the definitions of ``vllm bench serve``.

Definitions (all times in seconds on the client's monotonic clock, reported in ms):
- TTFT: request sent -> first streamed chunk that carries a choice.
- ITL: gaps between consecutive chunks that carry a choice.
- E2EL (latency): request sent -> last chunk that carries a choice.
- TPOT: (E2EL - TTFT) / (output tokens - 1), only for requests with more than one output token.
- Request throughput: completed requests / benchmark duration; output throughput: output
  tokens / duration; total token throughput: (input + output tokens) / duration.
Percentiles use linear interpolation between closest ranks (numpy's default method).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class RequestRecord:
    """What the client observed for one request. Built by :mod:`bench.client`."""

    success: bool
    prompt_len: int
    output_tokens: int
    start_time: float
    ttft: float
    latency: float
    itl: tuple[float, ...] = ()
    error: str = ""
    request_id: str = ""
    """The router's ``x-request-id`` for the request, where it answered one."""

    def tpot(self) -> float | None:
        """Seconds per output token after the first (vLLM's TPOT); None with fewer than two."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    """Summary statistics of one latency metric, in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[str, float] = field(default_factory=dict)

    def percentile(self, p: float) -> float:
        """Return the stored percentile ``p`` (must be one of those requested)."""
        return self.percentiles_ms[_pkey(p)]


@dataclass(frozen=True)
class BenchmarkMetrics:
    """Aggregate metrics of one benchmark run."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution


def _pkey(p: float) -> str:
    return f"p{p:g}"


def rounded_ratio(a: float, b: float) -> float | None:
    """``a / b`` to 3 decimals, the form of a summary.json ratio; None when ``b`` is not positive
    (nothing to compare with)."""
    return round(a / b, 3) if b > 0 else None


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); 0.0 for an empty sequence."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
    """Summarize a list of durations in seconds into a :class:`Distribution` in ms."""
    if not values_s:
        return Distribution(0.0, 0.0, 0.0, {_pkey(p): 0.0 for p in percentiles})
    mean = sum(values_s) / len(values_s)
    variance = sum((v - mean) ** 2 for v in values_s) / len(values_s)
    return Distribution(
        mean_ms=mean * 1000.0,
        median_ms=percentile(values_s, 50.0) * 1000.0,
        std_ms=math.sqrt(variance) * 1000.0,
        percentiles_ms={_pkey(p): percentile(values_s, p) * 1000.0 for p in percentiles},
    )


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchmarkMetrics:
    """Aggregate request records of one run lasting ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots = [t for r in ok if (t := r.tpot()) is not None]
    itls = [gap for r in ok for gap in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=summarize(ttfts, percentiles),
        tpot=summarize(tpots, percentiles),
        itl=summarize(itls, percentiles),
        e2el=summarize(e2els, percentiles),
    )


def counted_ttft(
    records: Sequence[RequestRecord],
    limit_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> Distribution:
    """TTFT over *every* request of a run, a failed one entering at ``limit_s`` (the run's cap).

    :func:`compute_metrics` describes completed requests only, which favours a stack that fails
    its slowest requests; this is the figure a comparison between stacks uses.
    """
    return summarize([r.ttft if r.success else limit_s for r in records], percentiles)
