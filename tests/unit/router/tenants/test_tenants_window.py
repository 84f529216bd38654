"""A sliding minute of counts and OpenAI's rate-limit headers built from it."""

from __future__ import annotations

import pytest

from disagg_router.router.tenants.headers import duration, rate_limit_headers
from disagg_router.router.tenants.window import Usage, Window


def test_takes_count_until_the_limit_and_a_refused_take_counts_nothing() -> None:
    w = Window(limit=3)
    assert [w.take(1, 10.0)[0] for _ in range(4)] == [True, True, True, False]
    assert w.usage(10.5).used == 3


def test_a_count_leaves_the_window_sixty_seconds_after_its_second_began() -> None:
    w = Window(limit=2)
    w.take(2, 10.7)
    assert not w.take(1, 69.9)[0]
    fits, usage = w.take(1, 70.0)
    assert fits and usage.used == 1


def test_over_any_minute_no_more_than_the_limit_is_taken() -> None:
    w = Window(limit=50)
    taken: list[tuple[float, int]] = []
    for step in range(3000):  # one take of 3 every 0.1 s for 300 s
        now = step * 0.1
        if w.take(3, now)[0]:
            taken.append((now, 3))
    for start in range(0, 240):
        assert sum(a for t, a in taken if start <= t < start + 60) <= 50


def test_wait_for_is_when_enough_has_left_the_window() -> None:
    w = Window(limit=10)
    w.take(4, 0.2)
    w.take(6, 30.5)
    usage = w.usage(40.0)
    assert usage.wait_for(1) == pytest.approx(20.0)  # the 4 of second 0 leave at 60
    assert usage.wait_for(5) == pytest.approx(50.0)  # the 6 of second 30 must leave too
    assert usage.reset_s == pytest.approx(50.0)
    assert Window(limit=10).usage(0.0).wait_for(10) == 0.0


def test_an_amount_larger_than_the_limit_fits_only_an_empty_window() -> None:
    w = Window(limit=10)
    assert w.take(25, 0.0)[0]
    assert not w.take(25, 1.0)[0]
    assert w.usage(1.0).wait_for(25) == pytest.approx(59.0)


def test_a_forced_correction_counts_beyond_the_limit_or_gives_back() -> None:
    w = Window(limit=10)
    w.take(8, 0.0)
    assert w.take(5, 1.0, force=True)[1].used == 13
    assert w.take(-6, 2.0, force=True)[1].used == 7
    assert w.take(3, 2.0)[0]


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
    usage = Usage(limit=100, now=30.0, slots=((10, 40), (29, 80)))
    assert rate_limit_headers("tokens", usage) == {
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "59s",
    }
