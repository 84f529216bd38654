"""``disagg-router serve --workers N``: N worker processes serve one port from the config file."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import yaml

from devstack.fake_vllm import FakeVllmServer
from devstack.ports import free_port
from devstack.process import ChildProcess, ProcessSpec
from tests.integration.router.router_fixtures import MODEL, sse_text
from tests.support.wait import wait_until

STREAM = {"model": MODEL, "prompt": "a b c", "max_tokens": 4, "stream": True}


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_two_workers_serve_streams_from_the_config_file(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    config = {
        "models": [MODEL],
        "prefill": {"instances": [{"url": fake["p0"].url}]},
        "decode": {"instances": [{"url": fake["d0"].url}]},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(path)]
    argv += ["--port", str(port), "--workers", "2"]
    with ChildProcess(ProcessSpec("router", tuple(argv), tmp_path / "router.log")) as proc:
        wait_until(lambda: _ready(url), timeout=60, what="a worker to be ready")
        texts = []
        with httpx.Client(timeout=10) as client:
            for _ in range(6):
                resp = client.post(f"{url}/v1/completions", json=STREAM)
                assert resp.status_code == 200
                texts.append(sse_text(resp.text, chat=False))
        wait_until(
            lambda: proc.log_tail(200).count("Started server process") == 2,
            timeout=60,
            what="both workers to start",
        )
    assert all(t and t == texts[0] for t in texts)
