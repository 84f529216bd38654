"""What changed between two scrapes (``bench.scrapes``): a histogram's median interpolated in its
bucket and the share above 0, nothing new giving zeros, several targets pooled as one."""

from __future__ import annotations

import pytest

from bench.scrapes import Samples, Scrape, delta, histogram, pooled

FAMILY = "disagg_push_wait_for_registration_seconds"


def scrape(buckets: dict[str, float], total: float) -> Scrape:
    count = buckets["+Inf"]
    series: Samples = {
        f"{FAMILY}_bucket": [(f"{FAMILY}_bucket", {"le": le}, n) for le, n in buckets.items()],
        f"{FAMILY}_count": [(f"{FAMILY}_count", {}, count)],
        f"{FAMILY}_sum": [(f"{FAMILY}_sum", {}, total)],
    }
    return {"p0": series}


def test_the_median_between_two_scrapes_is_interpolated_in_its_bucket() -> None:
    before = scrape({"0.0": 2, "0.01": 2, "0.1": 2, "+Inf": 2}, 0.0)
    # 10 new observations: 4 at 0, 4 in (0.01, 0.1], 2 above; the 5th and 6th are in (0.01, 0.1]
    after = scrape({"0.0": 6, "0.01": 6, "0.1": 10, "+Inf": 12}, 1.0)
    got = histogram(before, after, "p0", FAMILY)
    assert got["count"] == 10
    assert got["mean_ms"] == pytest.approx(100.0)
    assert got["p50_ms"] == pytest.approx(1000 * (0.01 + 0.25 * 0.09))
    assert got["nonzero"] == pytest.approx(0.6)  # P waited for 6 of the 10


def test_no_new_observation_gives_zeros() -> None:
    same = scrape({"0.0": 2, "+Inf": 2}, 0.0)
    assert histogram(same, same, "p0", FAMILY) == {
        "count": 0.0,
        "mean_ms": 0.0,
        "p50_ms": 0.0,
        "nonzero": 0.0,
    }


def test_pooled_targets_read_as_their_sum() -> None:
    before = {**scrape({"0.0": 1, "+Inf": 1}, 0.0), "p1": scrape({"0.0": 0, "+Inf": 0}, 0.0)["p0"]}
    after = {**scrape({"0.0": 2, "+Inf": 3}, 0.5), "p1": scrape({"0.0": 1, "+Inf": 1}, 0.0)["p0"]}
    names = ("p0", "p1")
    got = histogram(pooled(before, names, "ps"), pooled(after, names, "ps"), "ps", FAMILY)
    assert got["count"] == 3  # 2 on p0, 1 on p1
    assert got["nonzero"] == pytest.approx(1 / 3)  # p0's second observation was above 0
    assert (
        delta(pooled(before, names, "ps"), pooled(after, names, "ps"), "ps", f"{FAMILY}_sum") == 0.5
    )
    assert pooled(after, names, "ps")["p0"] == after["p0"]  # the targets stay as they were
