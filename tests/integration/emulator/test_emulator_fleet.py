"""The router over an emulated 8P8D fleet (the fast suite's scale smoke test): push mode with
KV-aware routing; every stream completes with its KV moved from P to D, a repeated prompt goes
back to the P that caches it, and when the load is over no engine holds a block."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.emulator import Fleet, FleetSpec, load_profile
from devstack.tiny_model import make_tiny_model
from disagg_router.router.config import settings_from_mapping
from tests.integration.router.router_fixtures import running_router, sse_payloads
from tests.support.wait import wait_until

SIZE = 8
BLOCK = 128


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("emulator") / "tiny")


@pytest.fixture(scope="module")
def fleet(tokenizer_dir: Path) -> Iterator[Fleet]:
    profile = replace(
        load_profile("cpu-tiny"), num_blocks=256
    )  # room for every prompt: no eviction
    spec = FleetSpec(profile, SIZE, SIZE, tokenizer_dir=str(tokenizer_dir))
    with Fleet(spec) as running:
        yield running


def _settings(fleet: Fleet, tokenizer_dir: Path) -> Any:
    return settings_from_mapping(
        {
            "models": [fleet.spec.profile.model],
            "mode": "push",
            "prefill": {"policy": "kv_aware", "instances": fleet.instances("prefill")},
            "decode": {"policy": "kv_aware", "instances": fleet.instances("decode")},
            "kv_events": {"enabled": True, "tokenizer": str(tokenizer_dir)},
            "health": {"interval": 3600},
        }
    )


def _stream(client: httpx.Client, prompt: str) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    usage: dict[str, Any] = json.loads(payloads[-2])["usage"]
    return usage


def _blocks_in_use(fleet: Fleet) -> list[int]:
    return fleet.call(
        lambda: [m.engine.pool.num_blocks - m.engine.pool.free_blocks for m in fleet.members]
    )


def _prefix_hits(fleet: Fleet) -> dict[str, int]:
    return fleet.call(
        lambda: {m.name: m.engine.pool.hits for m in fleet.members if m.role == "prefill"}
    )


def _kv_ready(url: str) -> bool:
    state = httpx.get(f"{url}/ready", timeout=5).json().get("kv_events", {}).get("tiny", {})
    streams = state.get("instances", {})
    return (
        state.get("tokenizer") == "loaded"
        and len(streams) == 2 * SIZE
        and all(s["state"] == "live" for s in streams.values())
    )


def test_router_serves_an_emulated_8p8d_fleet(fleet: Fleet, tokenizer_dir: Path) -> None:
    with running_router(_settings(fleet, tokenizer_dir)) as router:
        wait_until(lambda: _kv_ready(router.url), timeout=120.0, what="live KV event streams")
        prompts = [f"system prompt {n} " * 120 for n in range(SIZE * 2)]
        with httpx.Client(base_url=router.url, timeout=30.0) as client:
            for prompt in prompts:
                usage = _stream(client, prompt + "first question")
                assert usage["completion_tokens"] == 4
            # D computed no prompt token: its whole prompt came from P's KV
            assert fleet.fabric.transfers == len(prompts)
            before = sum(_prefix_hits(fleet).values())
            wait_until(
                lambda: _indexed_blocks(router.url) > 0, what="the router's index of P's blocks"
            )
            for prompt in prompts:
                _stream(client, prompt + "second question")
        hits = sum(_prefix_hits(fleet).values()) - before
        # each follow-up went to the P holding its prompt: it found every shared full block
        assert hits == sum(_shared_blocks(fleet, p) * BLOCK for p in prompts)
        wait_until(lambda: not any(_blocks_in_use(fleet)), what="every engine's blocks free")


def _shared_blocks(fleet: Fleet, prompt: str) -> int:
    """Full blocks the two questions after ``prompt`` share (the last token is never a hit)."""
    url = fleet.instances("prefill")[0]["url"]
    first, second = (
        httpx.post(f"{url}/tokenize", json={"prompt": prompt + q}).json()["tokens"]
        for q in ("first question", "second question")
    )
    pairs = enumerate(zip(first, second, strict=False))
    common = next((i for i, (a, b) in pairs if a != b), min(len(first), len(second)))
    return min(common, len(second) - 1) // BLOCK


def _indexed_blocks(url: str) -> int:
    state = httpx.get(f"{url}/ready", timeout=5).json()["kv_events"]["tiny"]
    return sum(s["blocks"] for name, s in state["instances"].items() if name.startswith("p"))


def _running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running"))
    return float(line.rsplit(" ", 1)[1])


def test_a_killed_engine_drops_its_streams_and_a_joined_one_serves() -> None:
    slow = replace(
        load_profile("cpu-tiny"), step=replace(load_profile("cpu-tiny").step, base_s=0.05)
    )
    with Fleet(FleetSpec(slow, 0, 1, kv_events=False)) as fleet:
        [entry] = fleet.instances("decode")
        errors: list[BaseException] = []

        def stream() -> None:
            body = {"prompt": [5] * 64, "max_tokens": 200, "stream": True}
            headers = {"x-request-id": "doomed"}
            try:
                with httpx.stream(
                    "POST", f"{entry['url']}/v1/completions", json=body, headers=headers, timeout=30
                ) as response:
                    for _ in response.iter_lines():
                        pass
            except httpx.HTTPError as exc:
                errors.append(exc)

        client = threading.Thread(target=stream)
        client.start()
        wait_until(lambda: _running(entry["url"]) == 1.0, what="the stream decoding")
        assert fleet.call(lambda: fleet.kill(entry["name"])) == ["doomed"]
        client.join(timeout=30)
        assert errors and isinstance(errors[0], httpx.RemoteProtocolError)
        joined = fleet.call_coroutine(fleet.add("decode"))
        assert joined["name"] == "d1"
        answer = httpx.post(
            f"{joined['url']}/v1/completions", json={"prompt": [5] * 8, "max_tokens": 2}, timeout=30
        )
        assert answer.status_code == 200
        assert [m["name"] for m in fleet.instances("decode")] == ["d1"]


@pytest.mark.parametrize("rate", [None, 2e5], ids=["cpu-seconds", "work"])
def test_engines_given_cores_spend_their_steps_there_until_the_fleet_stops(
    rate: float | None,
) -> None:
    core = min(os.sched_getaffinity(0))
    profile = replace(load_profile("cpu-tiny"), work_rate=rate)
    spec = FleetSpec(profile, 1, 1, kv_events=False, cpu_cores=(core,))
    with Fleet(spec) as fleet:
        burners = fleet.call(lambda: {m.name: m.engine.burner for m in fleet.members})
        p_burner = burners["p0"]
        assert p_burner is not None and burners["d0"] is None  # one core given: P's
        assert p_burner.work_rate == rate  # the profile's: steps spent as work when it has one
        pid = p_burner.pid
        assert pid is not None
        [entry] = fleet.instances("prefill")
        body = {"prompt": [5] * 64, "max_tokens": 1}
        assert (
            httpx.post(f"{entry['url']}/v1/completions", json=body, timeout=30).status_code == 200
        )
        assert fleet.call(lambda: p_burner.spent_s) > 0.0
        assert fleet.call(fleet.stats)["engines"]["p0"]["burner_failures"] == 0
    assert not Path(f"/proc/{pid}/cmdline").exists() or (
        b"devstack.burner" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
