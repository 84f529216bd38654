"""The upstream-client comparison's report: CPU per request relative to httpx."""

from __future__ import annotations

from bench.clients import format_report


def test_report_divides_by_httpx() -> None:
    median = {
        "httpx": {"cpu_ms_per_request": 1.2, "request_rate": 800.0},
        "httpx-aiohttp": {"cpu_ms_per_request": 0.48, "request_rate": 1500.0},
    }
    report = format_report({"median": median})
    assert "| httpx | 1.200 | 1.00x | 800 |" in report
    assert "| httpx-aiohttp | 0.480 | 0.40x | 1500 |" in report


def test_report_without_httpx_has_no_ratio() -> None:
    report = format_report({"median": {"aiohttp": {"cpu_ms_per_request": 0.3, "request_rate": 9}}})
    assert "| aiohttp | 0.300 | n/a | 9 |" in report
