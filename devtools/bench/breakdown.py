"""Per-stage TTFT of a benchmark point, from the histograms the stack exports on ``/metrics``.

Who calls it: the scenario sweep, around each point: :func:`scrape` every ``/metrics`` endpoint
of the target (router, P, D or the aggregated instance) before and after, then
:func:`histogram_means` gives the mean of each histogram below over exactly that point's
requests (delta of ``_sum`` / delta of ``_count``); :func:`router_stages` gives the router's
stages alone, by stage (the overhead, vllm-serve and fleet-routing benchmarks around their
loads). The router's stages add up to its TTFT
(``disagg_router.router.observability.timeline``); vLLM's and the connector's split P's and D's part
of it.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROUTER_STAGES = "disagg_router_ttft_stage_seconds"
"""The router's TTFT stage histogram (``disagg_router.router.observability.timeline``), one series
per ``stage`` label."""

HISTOGRAMS = (
    ROUTER_STAGES,
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:time_to_first_token_seconds",
    "disagg_push_write_seconds",
    "disagg_push_registration_to_write_seconds",
)
"""The histograms a point's breakdown reports (those an endpoint lacks are left out)."""

Totals = dict[str, tuple[float, float]]


def totals(text: str) -> Totals:
    """(sum, count) of each :data:`HISTOGRAMS` series in a ``/metrics`` text, keyed by name and
    the ``stage`` label where there is one (other labels are summed over)."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in HISTOGRAMS:
            continue
        for sample in family.samples:
            kind = sample.name.rsplit("_", 1)[-1]
            if kind not in ("sum", "count"):
                continue
            stage = sample.labels.get("stage")
            key = f"{family.name}{{{stage}}}" if stage else family.name
            pair = out.setdefault(key, [0.0, 0.0])
            pair[0 if kind == "sum" else 1] += sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


async def scrape(client: httpx.AsyncClient, urls: dict[str, str]) -> dict[str, Totals]:
    """:func:`totals` of each named ``/metrics`` URL; an endpoint that fails gives none."""
    out: dict[str, Totals] = {}
    for name, url in urls.items():
        try:
            resp = await client.get(url, timeout=10.0)
        except httpx.HTTPError:
            continue
        if resp.status_code == 200:
            out[name] = totals(resp.text)
    return out


def histogram_means(before: dict[str, Totals], after: dict[str, Totals]) -> dict[str, float]:
    """Mean milliseconds per observation between two scrapes, keyed ``<endpoint>:<series>``."""
    means: dict[str, float] = {}
    for name, series in after.items():
        for key, (total, count) in series.items():
            total0, count0 = before.get(name, {}).get(key, (0.0, 0.0))
            if count > count0:
                means[f"{name}:{key}"] = 1000 * (total - total0) / (count - count0)
    return means


def router_stages(
    before: dict[str, Totals], after: dict[str, Totals], name: str = "router"
) -> dict[str, float]:
    """Mean ms per request of each of the router's TTFT stages between two scrapes, keyed by
    stage; ``name``: what the scrapes call the router's ``/metrics``."""
    prefix = f"{name}:{ROUTER_STAGES}{{"
    means = histogram_means(before, after)
    return {k[len(prefix) : -1]: v for k, v in means.items() if k.startswith(prefix)}
