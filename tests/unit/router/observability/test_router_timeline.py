"""TTFT stages from a dispatch's marks: which stages apply and how they split the time."""

from __future__ import annotations

import pytest

from disagg_router.router.observability.timeline import STAGES, ttft_stages


def _timeline(**marks: float) -> dict[str, float]:
    """A dispatch's ``timings``: seconds since it was accepted."""
    return marks


def test_push_stages_add_up_to_the_router_ttft() -> None:
    t = _timeline(
        prefill_sent=0.001,
        decode_sent=0.002,
        prefill_done=0.5,
        first_token=0.6,
        client_first=0.601,
    )
    stages = ttft_stages(t)
    assert stages == pytest.approx(
        {
            "accept_to_legs_sent": 0.002,
            "prefill": 0.498,
            "prefill_done_to_first_token": 0.1,
            "relay_to_client": 0.001,
        }
    )
    assert sum(stages.values()) == pytest.approx(0.601)
    assert set(stages) <= set(STAGES)


def test_pull_mode_counts_the_decode_leg_after_prefill_in_the_gap() -> None:
    t = _timeline(
        prefill_sent=0.001, prefill_done=0.5, decode_sent=0.501, first_token=0.7, client_first=0.7
    )
    stages = ttft_stages(t)
    assert stages["accept_to_legs_sent"] == pytest.approx(0.001)
    assert stages["prefill_done_to_first_token"] == pytest.approx(0.2)


def test_first_token_before_the_prefill_answer_ends_the_prefill_stage() -> None:
    t = _timeline(
        prefill_sent=0.0, decode_sent=0.0, first_token=0.4, prefill_done=0.45, client_first=0.41
    )
    stages = ttft_stages(t)
    assert stages["prefill"] == pytest.approx(0.4)
    assert stages["prefill_done_to_first_token"] == 0.0


def test_decode_alone_and_unfinished_dispatches() -> None:
    alone = ttft_stages(_timeline(decode_sent=0.01, first_token=0.3, client_first=0.31))
    assert set(alone) == {"accept_to_legs_sent", "decode_to_first_token", "relay_to_client"}
    assert alone["decode_to_first_token"] == pytest.approx(0.29)
    assert ttft_stages(_timeline(prefill_sent=0.0, decode_sent=0.0)) == {}
