"""The soak report: samples from /proc and the markdown row."""

from __future__ import annotations

import os

from bench.soak import format_report, process_sample


def test_process_sample_reads_rss_and_fds_of_a_live_process() -> None:
    rss_kib, fds = process_sample(os.getpid())
    assert rss_kib > 1024 and fds >= 3


def test_report_gives_counts_and_first_last_max_of_the_samples_under_load() -> None:
    data = {
        "spec": {"backend": "fakes", "concurrency": 50, "duration_s": 120.0},
        "counts": {"completed": 900, "lost": 1, "garbled": 0, "errors": {"HTTP 502: x": 1}},
        "samples": [
            {"t_s": 0.0, "rss_kib": 51200, "fds": 10},  # before the load ramped up: not used
            {"t_s": 10.0, "rss_kib": 102400, "fds": 60},
            {"t_s": 60.0, "rss_kib": 112640, "fds": 70},
            {"t_s": 120.0, "rss_kib": 104448, "fds": 62},
            {"t_s": -1, "rss_kib": 999999, "fds": 9},  # after the load: not in the trend
        ],
    }
    report = format_report(data)
    assert "| fakes | 50 | 120 s | 901 | 1 | 0 |" in report
    assert "100.0 MiB -> 102.0 MiB (max 110.0 MiB, last - first 2.0 MiB)" in report
    assert "60 -> 62 (max 70, last - first 2)" in report
    assert "- 1 x HTTP 502: x" in report
