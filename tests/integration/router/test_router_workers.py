"""``disagg-router serve --workers N``: N worker processes serve one port from the config file."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from devstack.fake_vllm import FakeBehavior, FakeVllmServer
from devstack.ports import free_port
from devstack.process import ChildProcess, ProcessSpec
from tests.integration.router.router_fixtures import MODEL, sse_payloads, sse_text
from tests.support.wait import wait_until

STREAM = {"model": MODEL, "prompt": "a b c", "max_tokens": 4, "stream": True}


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _status(url: str) -> int | None:
    """The status of a new request to /ready; None when the connection fails (5 s bound)."""
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code
    except httpx.TransportError:
        return None


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` with ``labels`` one scrape of ``url/metrics`` shows."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def _worker_pids(log: str) -> list[int]:
    return [int(p) for p in re.findall(r"Started server process \[(\d+)\]", log)]


def test_metrics_of_two_workers_are_one_router(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    """Both workers serve streams from the config file (every answer the same text); every
    scrape, whichever worker answers it, shows the requests of both workers; workers that die
    leave their counts but not their gauges (a replaced worker's stream in flight is no longer
    in flight)."""
    fake["d0"].state.behavior = FakeBehavior(token_delay_s=0.05)
    config = {
        "models": [MODEL],
        "prefill": {"instances": [{"url": fake["p0"].url}]},
        "decode": {"instances": [{"url": fake["d0"].url}]},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "disagg_router.router.cli", "serve", "--config", str(path)]
    argv += ["--port", str(port), "--workers", "2"]
    requests = 12
    with ChildProcess(ProcessSpec("router", tuple(argv), tmp_path / "router.log")) as proc:
        wait_until(lambda: _ready(url), timeout=60, what="a worker to be ready")
        wait_until(lambda: len(_worker_pids(proc.log_tail(200))) == 2, 60, "both workers")
        texts = []
        for _ in range(requests):  # a connection each: the kernel spreads them over the workers
            resp = httpx.post(f"{url}/v1/completions", json=STREAM, timeout=10)
            assert resp.status_code == 200
            texts.append(sse_text(resp.text, chat=False))
        assert all(t and t == texts[0] for t in texts)
        ok = {"model": MODEL, "outcome": "ok"}
        counts = [_metric(url, "disagg_router_requests_total", **ok) for _ in range(8)]
        assert counts == [requests] * 8
        in_flight = "disagg_router_backend_in_flight"
        with contextlib.suppress(httpx.HTTPError):
            body = {**STREAM, "max_tokens": 400}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
                lines = resp.iter_lines()  # kept: a dropped iterator closes the stream
                next(lines)
                assert _metric(url, in_flight, role="decode") == 1
                for pid in _worker_pids(proc.log_tail(200)):
                    os.kill(pid, signal.SIGKILL)
                wait_until(lambda: len(_worker_pids(proc.log_tail(400))) == 4, 60, "2 more")
        wait_until(lambda: _ready(url), timeout=60, what="a new worker to be ready")
        assert _metric(url, in_flight, role="decode") == 0
        assert _metric(url, "disagg_router_requests_total", **ok) == requests


def test_workers_are_replaced_reloaded_and_drained_with_503(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    """A killed worker is replaced; SIGHUP to the parent reloads the file in each worker. After
    SIGTERM a worker with a stream in flight answers new requests 503 with Retry-After (no hang,
    no reset) until the stream is done, then every process exits."""
    fake["d0"].state.behavior = FakeBehavior(token_delay_s=0.02)
    config = {
        "models": [MODEL],
        "prefill": {"instances": [{"url": fake["p0"].url}]},
        "decode": {"instances": [{"url": fake["d0"].url}]},
        "drain": {"timeout": 30},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "disagg_router.router.cli", "serve", "--config", str(path)]
    argv += ["--port", str(port), "--workers", "2"]
    body = {**STREAM, "max_tokens": 150}
    with ChildProcess(ProcessSpec("router", tuple(argv), tmp_path / "router.log")) as proc:
        assert proc.pid is not None
        wait_until(lambda: _ready(url), timeout=60, what="a worker to be ready")
        wait_until(
            lambda: proc.log_tail(200).count("Application startup complete") == 2,
            timeout=60,
            what="both workers to start",
        )
        killed = int(re.findall(r"Started server process \[(\d+)\]", proc.log_tail(200))[0])
        os.kill(killed, signal.SIGKILL)
        wait_until(
            lambda: proc.log_tail(200).count("Application startup complete") == 3,
            timeout=60,
            what="a worker in place of the killed one",
        )
        os.kill(proc.pid, signal.SIGHUP)
        wait_until(
            lambda: proc.log_tail(200).count("config reloaded from") == 2,
            timeout=30,
            what="both workers to reload the file",
        )
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            first = next(lines)
            os.kill(proc.pid, signal.SIGTERM)
            wait_until(lambda: _status(url) == 503, 10, "a draining worker to answer 503")
            refused = httpx.post(f"{url}/v1/completions", json=STREAM, timeout=5)
            rest = "\n".join(lines)
        wait_until(lambda: proc.poll() is not None, 40, "every process to exit")
        ended = _status(url)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert sse_payloads(first + "\n\n" + rest + "\n\n")[-1] == "[DONE]"
    assert ended is None  # refused at once: nobody keeps the port open
    assert proc.poll() == 0
