"""What the router learns of an instance's pace: a P's prefill speed, queue and margin (how early
its prefills end against the binding's predictions), a D's lead."""

from __future__ import annotations

import pytest

from disagg_router.router.instances.pace import (
    DEFAULT_LEAD_S,
    MIN_SAMPLES,
    PrefillPace,
    Spread,
)

T0 = 1000.0


def taught(seconds_per_token: float, tokens: int = 1000) -> tuple[PrefillPace, float]:
    """A pace that saw ``MIN_SAMPLES`` prefills of ``tokens`` back to back at that speed;
    and the moment the last one ended."""
    pace = PrefillPace()
    now = T0
    for _ in range(MIN_SAMPLES):
        ticket = pace.send(tokens, now)
        now += seconds_per_token * tokens
        pace.done(ticket, now, answered=True)
    return pace, now


def test_no_prediction_until_enough_prefills_answered() -> None:
    pace = PrefillPace()
    now = T0
    for _ in range(MIN_SAMPLES - 1):
        ticket = pace.send(100, now)
        assert pace.finish(ticket, now) is None
        now += 1.0
        assert pace.done(ticket, now, answered=True) is None  # nothing was predicted
    ticket = pace.send(100, now)
    assert pace.finish(ticket, now) is None
    pace.done(ticket, now + 1.0, answered=True)
    assert pace.seconds_per_token == pytest.approx(0.01)


def test_prefills_queue_first_come_first_served() -> None:
    pace, now = taught(0.001)
    first, second, third = (pace.send(1000, now) for _ in range(3))
    assert [pace.finish(t, now) for t in (first, second, third)] == pytest.approx(
        [now + 1.0, now + 2.0, now + 3.0]
    )
    # the first ends half a second early: the ones behind it move up, and P seems faster
    assert pace.done(first, now + 0.5, answered=True) == pytest.approx(-0.5)
    per_token = pace.seconds_per_token
    assert per_token is not None and 0.0005 < per_token < 0.001
    assert pace.finish(second, now + 0.5) == pytest.approx(now + 0.5 + 1000 * per_token)
    assert pace.finish(third, now + 0.5) == pytest.approx(now + 0.5 + 2000 * per_token)


def test_an_overdue_prefill_is_taken_to_end_now() -> None:
    pace, now = taught(0.001)
    first, second = pace.send(1000, now), pace.send(1000, now)
    later = now + 5.0  # the first should have ended 4 s ago
    assert pace.finish(first, later) == pytest.approx(later)
    assert pace.finish(second, later) == pytest.approx(later + 1.0)


def test_speed_is_learnt_from_service_times_not_from_time_in_the_queue() -> None:
    pace = PrefillPace()
    now = T0
    for _ in range(MIN_SAMPLES):
        a, b = pace.send(1000, now), pace.send(1000, now)  # sent together
        pace.done(a, now + 2.0, answered=True)  # each took 2 s of P's time
        pace.done(b, now + 4.0, answered=True)  # b waited 2 s for a, then took 2 s
        now += 4.0
    assert pace.seconds_per_token == pytest.approx(0.002)


def test_a_prefill_that_did_not_answer_leaves_the_queue_teaching_nothing() -> None:
    pace, now = taught(0.001)
    heard: list[str] = []
    pace.listen(lambda: heard.append("ended"))
    failed, behind = pace.send(1000, now), pace.send(1000, now)
    assert pace.done(failed, now + 0.1, answered=False) is None
    assert heard == ["ended"]
    assert pace.seconds_per_token == pytest.approx(0.001)
    assert pace.finish(failed, now + 0.1) is None
    assert pace.finish(behind, now + 0.1) == pytest.approx(now + 1.0)


def test_a_d_lead_is_its_mean_plus_one_deviation() -> None:
    lead = Spread(weight=0.5, default=DEFAULT_LEAD_S)
    assert lead.bound() == DEFAULT_LEAD_S
    lead.observe(0.1)
    assert lead.bound() == pytest.approx(0.1)
    lead.observe(0.3)  # deviation 0.5 * 0.2 = 0.1; mean 0.2
    assert lead.bound() == pytest.approx(0.2 + 0.1)


def test_a_prefill_ending_before_the_bindings_prediction_widens_the_margin() -> None:
    pace, now = taught(0.001)
    assert pace.margin() == 0.0
    sent_only = pace.send(1000, now)  # nobody asked after sending (bound eagerly)
    pace.done(sent_only, now + 0.2, answered=True)  # 0.8 s early against the send's prediction
    assert pace.margin() == 0.0
    now += 0.2
    asked = pace.send(5000, now)
    predicted = pace.finish(asked, now)  # the binding asks
    assert predicted is not None
    pace.done(asked, predicted - 0.3, answered=True)
    assert pace.margin() == pytest.approx(0.3)
    now = predicted - 0.3
    late = pace.send(5000, now)
    predicted = pace.finish(late, now)
    assert predicted is not None
    pace.done(late, predicted + 0.5, answered=True)  # late: counts as 0 s early
    assert pace.margin() == pytest.approx(0.24 + 0.06)  # mean fell to 0.24, deviation grew
