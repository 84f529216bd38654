"""Hot reload on a real router with fake vLLM instances: a valid file is swapped in (new models,
instances drained and probed), an invalid one is rejected while the old config keeps serving,
and SIGHUP reloads the ``disagg-router serve`` process."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

from devstack.fake_vllm import FakeBehavior, FakeVllmServer
from devstack.ports import free_port
from devstack.process import ChildProcess, ProcessSpec
from disagg_router.router.config import load_config
from tests.integration.router.router_fixtures import MODEL, running_router, sse_text
from tests.support.wait import wait_until


def _config(p: list[str], d: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "models": [MODEL],
        "prefill": {"instances": [{"url": u} for u in p]},
        "decode": {"instances": [{"url": u} for u in d]},
        "health": {"interval": 3600, "unhealthy_interval": 0.1},
        **extra,
    }


def _write(path: Path, data: dict[str, Any] | str) -> None:
    text = data if isinstance(data, str) else yaml.safe_dump(data)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomic, as a config management tool would do


def _reloads(url: str, result: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'disagg_router_config_reloads_total{{result="{result}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_removed_decode_finishes_its_stream_and_the_new_one_is_checked_first(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    """d0 streams while a reload replaces it by d1, which is not serving yet: the stream ends
    normally on d0, no leg goes to d1 until it passes a health check, then d1 serves."""
    p, d0 = fake["p0"], fake["d0"]
    d1 = FakeVllmServer()  # port reserved; starts serving later
    d0.state.behavior = FakeBehavior(token_delay_s=0.5)  # a 75 s stream, sped up below
    path = tmp_path / "router.yaml"
    _write(path, _config([p.url], [d0.url], reload={"watch": True}))
    body = {"model": MODEL, "prompt": "long", "max_tokens": 150, "stream": True}
    with running_router(load_config(path), config_path=path) as router:
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as resp:
            chunks = resp.iter_text()
            first = next(chunks)  # committed on d0
            _write(path, _config([p.url], [d1.url], reload={"watch": True}))
            wait_until(lambda: _reloads(router.url, "applied") == 1, what="the reload")
            assert d0.state.in_flight == 1  # the reload happened mid-stream
            d0.state.behavior.token_delay_s = 0.0  # let the stream finish now
            rest = "".join(chunks)
        short = {**body, "stream": False, "max_tokens": 2}
        before_check = httpx.post(f"{router.url}/v1/completions", json=short)
        with d1:
            wait_until(
                lambda: httpx.get(f"{router.url}/ready").json()["decode"] == [d1.url],
                what="d1 to pass its health check",
            )
            after = httpx.post(f"{router.url}/v1/completions", json=short)
    assert sse_text(first + rest, chat=False)
    assert rest.rstrip().endswith("data: [DONE]")
    assert [r.outcome for r in d0.state.generation_requests()] == ["ok"]  # nothing new on d0
    assert before_check.status_code == 503  # d1 not checked yet, d0 gone: no decode usable
    assert after.status_code == 200
    assert len(d1.state.generation_requests()) == 1


def test_invalid_file_is_rejected_and_the_old_config_keeps_serving(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    p, d = fake["p0"], fake["d0"]
    path = tmp_path / "router.yaml"
    good = _config([p.url], [d.url], reload={"watch": True})
    _write(path, good)
    with running_router(load_config(path), config_path=path) as router:
        bad = json.loads(json.dumps(good))
        bad["decode"]["instances"][0]["url"] = "not a url"
        _write(path, bad)
        wait_until(lambda: _reloads(router.url, "rejected") == 1, what="the rejection")
        _write(path, "models: [unclosed\n")
        wait_until(lambda: _reloads(router.url, "rejected") == 2, what="the second rejection")
        still = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        renamed = {**good, "models": ["renamed"]}
        _write(path, renamed)
        wait_until(lambda: _reloads(router.url, "applied") == 1, what="the valid reload")
        models = httpx.get(f"{router.url}/v1/models").json()
        old_name = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert still.status_code == 200
    assert [m["id"] for m in models["data"]] == ["renamed"]
    assert old_name.status_code == 404


def test_sighup_reloads_the_serving_process(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    p, d = fake["p0"], fake["d0"]
    path = tmp_path / "router.yaml"
    _write(path, _config([p.url], [d.url]))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = (
        sys.executable,
        "-m",
        "disagg_router.router.cli",
        "serve",
        "--config",
        str(path),
        "--port",
        str(port),
    )
    with ChildProcess(ProcessSpec("router", argv, tmp_path / "router.log")) as proc:
        wait_until(lambda: _up(url), timeout=60, what="the router to serve")
        _write(path, {**_config([p.url], [d.url]), "models": [MODEL, "second"]})
        assert proc.pid is not None

        os.kill(proc.pid, signal.SIGHUP)
        wait_until(lambda: _reloads(url, "applied") == 1, what="the SIGHUP reload")
        models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        log = proc.log_tail(200)
    assert models == [MODEL, "second"]
    assert "config reloaded from" in log


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _configmap_update(mount: Path, name: str, data: dict[str, Any], version: int) -> None:
    """Write ``data`` the way the kubelet updates a ConfigMap volume: a new timestamped directory,
    a ``..data_tmp`` symlink to it renamed over ``..data``, the old directory removed; ``name``
    in the mount is a symlink through ``..data``."""
    stamp = mount / f"..2026_12_02_06_00_0{version}.{1000 + version}"
    stamp.mkdir()
    _write(stamp / name, data)
    old = os.readlink(mount / "..data") if (mount / "..data").is_symlink() else None
    os.symlink(stamp.name, mount / "..data_tmp")
    os.rename(mount / "..data_tmp", mount / "..data")
    if not (mount / name).is_symlink():
        os.symlink(f"..data/{name}", mount / name)
    if old is not None:
        for child in (mount / old).iterdir():
            child.unlink()
        (mount / old).rmdir()


def test_watch_follows_every_configmap_update(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    """A config file mounted from a ConfigMap, updated twice: both updates are applied."""
    p, d0, d1 = fake["p0"], fake["d0"], fake["d1"]
    mount = tmp_path / "config"
    mount.mkdir()
    watch = {"reload": {"watch": True}, "health": {"interval": 3600, "unhealthy_interval": 0.1}}
    _configmap_update(mount, "router.yaml", _config([p.url], [d0.url], **watch), 1)
    path = mount / "router.yaml"
    with running_router(load_config(path), config_path=path) as router:

        def decode() -> list[str]:
            listed: list[str] = httpx.get(f"{router.url}/ready").json()["decode"]
            return listed

        _configmap_update(mount, "router.yaml", _config([p.url], [d1.url], **watch), 2)
        wait_until(lambda: decode() == [d1.url], what="the first update")
        _configmap_update(mount, "router.yaml", _config([p.url], [d0.url], **watch), 3)
        wait_until(lambda: decode() == [d0.url], what="the second update")
        applied = _reloads(router.url, "applied")
    assert applied == 2
