"""``disagg-bench fleet-failover``'s arithmetic: the offered rate and the kill times, the figures
from the client's records and a fresh router's samples, and the report (the run starts an
emulated fleet: tests/integration/bench)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fleet_failover import COMPUTED, FleetFailoverSpec, Kill, figures, run_fleet_failover
from bench.fleet_failover_cmd import format_report
from bench.metrics import RequestRecord
from bench.scrapes import Samples
from devstack.emulator.profile import load_profile

SPEC = FleetFailoverSpec(size=4, requests=40, kills=3, output_len=4)


def test_the_rate_keeps_every_p_at_its_fraction_and_kills_spread_over_the_arrivals() -> None:
    per_p = load_profile(SPEC.profile).prefill_seconds(SPEC.input_len)
    assert SPEC.rate() == pytest.approx(0.5 * 4 / per_p)
    span = 40 / SPEC.rate()
    assert SPEC.kill_times() == pytest.approx([span / 4, span / 2, 3 * span / 4])


def _stream(rid: str, gaps: tuple[float, ...], ttft: float = 1.0) -> RequestRecord:
    return RequestRecord(True, 8192, len(gaps) + 1, 0.0, ttft, ttft + sum(gaps), gaps, "", rid)


def _router() -> Samples:
    bucket = f"{COMPUTED}_bucket"
    edges = [("0", 0.0), ("128", 0.0), ("256", 1.0), ("512", 2.0), ("+Inf", 2.0)]
    return {
        "disagg_router_stream_migrations_total": [
            ("disagg_router_stream_migrations_total", {"outcome": "resumed"}, 2.0)
        ],
        "disagg_router_decode_failovers_total": [
            ("disagg_router_decode_failovers_total", {"phase": "after_first_token"}, 2.0),
            ("disagg_router_decode_failovers_total", {"phase": "before_first_token"}, 1.0),
        ],
        bucket: [(bucket, {"phase": "after_first_token", "le": le}, v) for le, v in edges]
        + [(bucket, {"phase": "before_first_token", "le": "128"}, 1.0)],
        f"{COMPUTED}_count": [
            (f"{COMPUTED}_count", {"phase": "after_first_token"}, 2.0),
            (f"{COMPUTED}_count", {"phase": "before_first_token"}, 1.0),
        ],
        f"{COMPUTED}_sum": [
            (f"{COMPUTED}_sum", {"phase": "after_first_token"}, 500.0),
            (f"{COMPUTED}_sum", {"phase": "before_first_token"}, 100.0),
        ],
    }


def test_figures_follow_the_streams_that_were_on_a_killed_d() -> None:
    records = [
        _stream("a", (0.01, 0.3, 0.01)),  # on the killed D: resumed after 300 ms
        _stream("b", (0.01, 0.01, 0.5)),  # on the killed D: 500 ms
        _stream("c", (0.01, 0.01, 0.01), ttft=2.0),
        _stream("d", (0.01, 0.01)),  # 3 tokens of 4: not whole
        RequestRecord(False, 8192, 0, 0.0, 0.0, 0.0, (), "HTTP 502", "e"),
    ]
    kills = [Kill("d1", 5.0, ("a", "b", "gone"))]
    found = figures(records, kills, _router(), SPEC)
    assert (found["streams"], found["whole"]) == (5, 3)
    assert [f["id"] for f in found["not_whole"]] == ["d", "e"]
    assert (found["on_killed"], found["on_killed_whole"]) == (2, 2)
    assert found["resume_s"] == {"p50": pytest.approx(0.4), "max": 0.5, "count": 2}
    assert found["ttft_p50_s"] == 1.0  # over the 4 answered streams: 1, 1, 2, 1
    assert found["kills"] == [{"name": "d1", "at_s": 5.0, "in_flight": 3}]
    assert found["migrations"] == {"resumed": 2.0}
    assert found["failovers"] == {"after_first_token": 2.0, "before_first_token": 1.0}
    after = found["p_computed_tokens"]["after_first_token"]
    assert after == {"count": 2.0, "mean": 250.0, "at_most": 512.0}
    assert found["summary"] == {
        "migration_completed_fraction_4p4d_emulated": 0.6,
        "migration_resume_over_full_retry_4p4d_emulated": 0.4,
        "migration_p_prompt_tokens_max_4p4d_emulated": 512.0,
    }
    report = format_report({"spec": vars(SPEC), "rate": 2.0, **found})
    assert "| streams whole ([DONE], 4 tokens, no error) | 3 / 5 |" in report
    assert "| kills | d1 at 5.0 s (3 in flight) |" in report
    assert "p50 400 ms, max 500 ms (2 streams)" in report
    assert "after_first_token: 2 attempts, mean 250, at most 512" in report
    assert "- `e`: 0 tokens, HTTP 502" in report


def test_as_many_kills_as_ds_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kills must be below size"):
        run_fleet_failover(FleetFailoverSpec(size=2, kills=2), tmp_path)
