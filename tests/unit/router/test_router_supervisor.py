"""The supervisor of background tasks: a crash is logged, counted, shown and restarted with a
growing delay; a crashed health monitor does not hold requests back."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from devstack.fake_vllm import UvicornThread
from disagg_router.router.config import settings_from_mapping
from disagg_router.router.http.app import create_app
from disagg_router.router.observability.metrics import RouterMetrics
from disagg_router.router.supervisor import Supervisor
from tests.unit.router.mock_upstream import answer, pair


class Flaky:
    """Crashes (raises, then returns) on its first two runs, then runs until cancelled."""

    def __init__(self) -> None:
        self.runs = 0
        self.steady = asyncio.Event()

    async def run(self) -> None:
        self.runs += 1
        if self.runs == 1:
            raise RuntimeError("boom")
        if self.runs == 2:
            return  # ending is a crash too: a supervised task runs until cancelled
        self.steady.set()
        await asyncio.Event().wait()


async def test_a_crashed_task_is_logged_counted_shown_and_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    sup = Supervisor(RouterMetrics(registry), backoff=0.01, max_backoff=0.02)
    flaky = Flaky()
    errors: list[str] = []
    with caplog.at_level(logging.ERROR, logger="disagg_router.router.supervisor"):
        task = sup.start("flaky", flaky.run, on_crash=errors.append)
        await asyncio.wait_for(flaky.steady.wait(), 10)
    health = sup.status()["flaky"]
    assert flaky.runs == 3 and health.running and health.crashes == 2
    assert errors == ["RuntimeError: boom", "ended"] and health.last_error == "ended"
    assert sup.crashed("flaky").is_set()
    crashes = registry.get_sample_value("disagg_router_background_crashes_total", {"task": "flaky"})
    assert crashes == 2
    assert any(r.exc_info and "boom" in str(r.exc_info[1]) for r in caplog.records)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert sup.status() == {}


def test_a_health_monitor_that_crashes_before_its_first_check_holds_no_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug makes every health check raise an unexpected error: the monitor crashes (and is
    restarted), /ready shows it, and requests are served without waiting for a first check that
    will not come (before: 5 s each)."""

    async def buggy_get(*args: object) -> bytes:
        raise RuntimeError("transport bug")

    monkeypatch.setattr("disagg_router.router.health.monitor.get_ok", buggy_get)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer(" ok", None))

    with pair(handler) as (p, d):
        settings = settings_from_mapping(
            {
                "models": ["m"],
                "mode": "pull",
                "prefill": {"instances": [{"url": p}]},
                "decode": {"instances": [{"url": d}]},
                "disaggregation": {"min_prompt_tokens": 1000},  # D alone: one scripted answer
            }
        )
        with UvicornThread(create_app(settings)) as server:
            resp = httpx.post(
                f"{server.url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=3
            )
            ready: dict[str, Any] = httpx.get(f"{server.url}/ready").json()
            metrics = httpx.get(f"{server.url}/metrics").text
    assert resp.status_code == 200, resp.text
    monitor = ready["background"]["health_monitor"]
    assert monitor["crashes"] >= 1 and "transport bug" in monitor["last_error"]
    assert 'disagg_router_background_crashes_total{task="health_monitor"}' in metrics
