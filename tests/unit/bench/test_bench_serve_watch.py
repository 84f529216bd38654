"""``bench.serve_watch``: CPU shares and router stages recorded around a ``vllm-serve`` client
run (this process stands in for the watched ones; no router, so no stages)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from bench.breakdown import ROUTER_STAGES, router_stages
from bench.serve_watch import PointWatch, process_shares, watched


def test_shares_are_cpu_over_the_run_duration_and_per_completed_request() -> None:
    shares = process_shares({"router": 3.0, "prefill": 12.0}, duration_s=12.0, completed=384)
    assert shares["router"] == {
        "cpu_s": 3.0,
        "cores": 0.25,
        "cpu_ms_per_request": pytest.approx(7.8125),
    }
    assert shares["prefill"]["cores"] == 1.0
    empty = process_shares({"router": 1.0}, duration_s=0.0, completed=0)["router"]
    assert empty["cores"] is None and empty["cpu_ms_per_request"] is None
    assert "main_thread_wait_share" not in empty


def test_main_thread_wait_share_is_wait_over_run_plus_wait() -> None:
    shares = process_shares({"router": 1.0}, 10.0, 10, {"router": (3.0, 1.0)})
    row = shares["router"]
    assert (row["main_thread_run_s"], row["main_thread_wait_s"]) == (3.0, 1.0)
    assert row["main_thread_wait_share"] == 0.25
    idle = process_shares({"router": 0.0}, 10.0, 10, {"router": (0.0, 0.0)})["router"]
    assert idle["main_thread_wait_share"] is None


def test_router_stages_are_the_mean_between_two_scrapes() -> None:
    key = f"{ROUTER_STAGES}{{accept_to_legs_sent}}"
    before = {"router": {key: (1.0, 10.0)}}
    after = {"router": {key: (1.0 + 0.108 * 384, 10.0 + 384)}}
    assert router_stages(before, after) == {"accept_to_legs_sent": pytest.approx(108.0)}
    assert router_stages(before, before) == {}


def test_watched_times_the_processes_over_the_run() -> None:
    def busy() -> dict[str, Any]:
        total = 0
        for i in range(2_000_000):
            total += i
        return {"duration": 0.5, "completed": 4, "sum": total}

    data, seen = watched(PointWatch(None, (("router", os.getpid()), ("gone", 2**22 + 1))), busy)
    assert data["completed"] == 4
    assert seen["router_stages_ms"] == {}
    assert seen["processes"]["router"]["cpu_s"] > 0
    assert seen["processes"]["gone"]["cpu_s"] == 0.0  # a pid that does not exist reads 0
    assert seen["processes"]["router"]["main_thread_run_s"] > 0  # the busy loop ran on a CPU
    assert seen["processes"]["gone"]["main_thread_wait_share"] is None
