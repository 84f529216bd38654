"""Snapshots of instances' and routers' ``/metrics`` and what changed between two of them.

Who calls it: :mod:`bench.binding` and :mod:`bench.fleet_binding` scrape every instance and the
router before and after a measured load and read counters, labelled counters and histograms from
the difference. Read-only: a scrape is one GET per URL.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[str, dict[str, str], float]]]
"""One target's samples by series name: ``(name, labels, value)`` each."""
Scrape = dict[str, Samples]
"""Samples by target name."""


async def scrape(client: httpx.AsyncClient, urls: dict[str, str]) -> Scrape:
    """Every target's ``/metrics`` (``urls``: target name -> base URL), one after another."""
    out: Scrape = {}
    for name, url in urls.items():
        text = (await client.get(f"{url}/metrics", timeout=10.0)).text
        found: Samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                found.setdefault(s.name, []).append((s.name, dict(s.labels), s.value))
        out[name] = found
    return out


def pooled(snapshot: Scrape, names: Iterable[str], as_name: str) -> Scrape:
    """``snapshot`` with the samples of the targets ``names`` also under ``as_name``, so that
    :func:`delta`, :func:`by_label` and :func:`histogram` read their sums (a fleet's P as one)."""
    merged: Samples = {}
    for name in names:
        for series, samples in snapshot.get(name, {}).items():
            merged.setdefault(series, []).extend(samples)
    return {**snapshot, as_name: merged}


def delta(before: Scrape, after: Scrape, name: str, series: str) -> float:
    """How much ``series`` (summed over its labels) of target ``name`` grew."""

    def total(snapshot: Scrape) -> float:
        return sum(v for _, _, v in snapshot.get(name, {}).get(series, []))

    return total(after) - total(before)


def by_label(before: Scrape, after: Scrape, name: str, series: str, label: str) -> dict[str, float]:
    """How much ``series`` of target ``name`` grew per value of ``label`` (those that grew)."""

    def split(snapshot: Scrape) -> dict[str, float]:
        out: dict[str, float] = {}
        for _, labels, value in snapshot.get(name, {}).get(series, []):
            out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + value
        return out

    b, a = split(before), split(after)
    return {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0) > 0}


def histogram(before: Scrape, after: Scrape, name: str, family: str) -> dict[str, float]:
    """Observations, mean (ms), the bucket-interpolated median (ms) and the share above 0
    (``nonzero``) of histogram ``family`` of target ``name`` between two scrapes."""
    buckets = by_label(before, after, name, f"{family}_bucket", "le")
    count = delta(before, after, name, f"{family}_count")
    total = delta(before, after, name, f"{family}_sum")
    if count <= 0:
        return {"count": 0.0, "mean_ms": 0.0, "p50_ms": 0.0, "nonzero": 0.0}
    edges = sorted((float(le), n) for le, n in buckets.items())
    zero = sum(n for edge, n in edges if edge == 0.0)
    low, below, p50 = 0.0, 0.0, 0.0
    for edge, cumulative in edges:
        if cumulative >= count / 2:
            inside = cumulative - below
            share = (count / 2 - below) / inside if inside > 0 else 0.0
            p50 = low + share * ((edge if math.isfinite(edge) else low) - low)
            break
        low, below = edge, cumulative
    return {
        "count": count,
        "mean_ms": 1000 * total / count,
        "p50_ms": 1000 * p50,
        "nonzero": 1 - zero / count,
    }
