"""A per-minute limit's bucket (fake clock) and OpenAI's rate-limit headers built from it."""

from __future__ import annotations

import pytest

from disagg_router.router.tenants.bucket import Bucket, Rate, Usage
from disagg_router.router.tenants.headers import duration, rate_limit_headers

MINUTE = Rate(limit=6, burst_s=60.0)  # a whole minute's worth at once; one back every 10 s


def test_takes_count_until_the_bucket_is_empty_and_a_refused_take_counts_nothing() -> None:
    b = Bucket()
    assert [b.take(MINUTE, 1, 100.0)[0] for _ in range(7)] == [True] * 6 + [False]
    assert b.take(MINUTE, 0, 100.0)[1].remaining == 0


def test_the_bucket_refills_at_the_limit_per_minute() -> None:
    b = Bucket()
    b.take(MINUTE, 6, 100.0)
    assert not b.take(MINUTE, 1, 109.9)[0]
    counted, usage = b.take(MINUTE, 1, 110.0)
    assert counted and usage.remaining == 0 and usage.reset_s == pytest.approx(60.0)


def test_a_greedy_tenant_gets_its_share_every_few_seconds_not_a_minute_at_once() -> None:
    rate, b = Rate(limit=600, burst_s=10.0), Bucket()  # 10/s, at most 100 at once
    taken = [step * 0.01 for step in range(60_000) if b.take(rate, 1, step * 0.01)[0]]
    assert sum(1 for t in taken if t < 10.0) <= 100 + 100  # burst + 10 s of refill
    for start in range(10, 590, 10):  # every later 10 s: its share, 100, within one
        assert abs(sum(1 for t in taken if start <= t < start + 10) - 100) <= 1
    for start in range(0, 540, 7):
        assert sum(1 for t in taken if start <= t < start + 60) <= 600 + 100


def test_the_burst_is_at_least_one_unit() -> None:
    rate = Rate(limit=2, burst_s=1.0)
    assert rate.capacity == 1.0
    b = Bucket()
    assert [b.take(rate, 1, 0.0)[0], b.take(rate, 1, 0.0)[0]] == [True, False]


def test_wait_for_is_when_the_amount_fits_again() -> None:
    b = Bucket()
    b.take(MINUTE, 5, 0.0)
    usage = b.take(MINUTE, 0, 20.0)[1]  # 2 units back: 3 left, 30 s to full
    assert usage.remaining == 3
    assert usage.wait_for(3) == 0.0
    assert usage.wait_for(5) == pytest.approx(20.0)
    assert usage.reset_s == pytest.approx(30.0)


def test_an_amount_larger_than_the_burst_is_taken_from_a_full_bucket_only() -> None:
    b = Bucket()
    assert b.take(MINUTE, 20, 0.0)[0]  # owes 14 units: 200 s to full
    assert not b.take(MINUTE, 20, 100.0)[0]
    assert b.take(MINUTE, 20, 200.0)[0]


def test_a_forced_correction_counts_beyond_the_limit_or_gives_back() -> None:
    b = Bucket()
    b.take(MINUTE, 4, 0.0)
    assert b.take(MINUTE, 5, 0.0, force=True)[1].reset_s == pytest.approx(90.0)
    assert b.take(MINUTE, -7, 0.0, force=True)[1].remaining == 4
    assert b.take(MINUTE, -100, 0.0, force=True)[1].remaining == 6  # never above full


def test_durations_are_written_as_openai_writes_reset_times() -> None:
    assert [duration(s) for s in (0.0, 0.25, 0.0004, 12.2, 66.0, 120.0)] == [
        "0s",
        "250ms",
        "1ms",
        "12s",
        "1m6s",
        "2m0s",
    ]


def test_headers_say_limit_remaining_and_reset() -> None:
    usage = Usage(Rate(limit=100, burst_s=60.0), owed=99.0)  # 0.6 s a token
    assert rate_limit_headers("tokens", usage) == {
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "1",
        "x-ratelimit-reset-tokens": "59s",  # 59.4 s
    }
