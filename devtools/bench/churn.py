"""Instances joining and leaving under load: one joins or leaves every second while requests
stream through the router; which requests failed, and whether a killed instance explains each.

Who calls it: ``disagg-bench churn`` (:mod:`bench.churn_cmd`). It starts an emulated fleet
(``python -m devstack.emulator``, on the first core) and our router in push mode over it (on the
last core) with its config file, then offers Poisson streamed load for ``seconds``. Every
second it either kills a random instance (the emulator drops its connections as a dead process's
would; at least ``min_each`` of each role stay) or starts a new one, alternating, then rewrites
the router's file with the live instances and sends SIGHUP (the router reloads it). A request
that fails is *explained* when the router's last dispatch id for it (its ``x-request-id``) was
in flight on an instance when that instance was killed; ``churn_failed_requests`` counts the
others.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.emulated_stack import (
    FleetSetup,
    RunningFleet,
    fewest_in_flight_config,
    fleet_behind_router,
)
from devstack.emulator.profile import load_profile
from devstack.process import ChildProcess


@dataclass(frozen=True)
class ChurnSpec:
    size: int = 4
    min_each: int = 2
    seconds: float = 300.0
    rate: float = 10.0
    prompt_tokens: int = 512
    output_tokens: int = 32
    profile: str = "cpu-tiny"
    seed: int = 0


@dataclass
class Outcome:
    """One request as the client saw it."""

    ok: bool
    request_id: str | None
    error: str | None = None


@dataclass
class Churn:
    """What the churn loop did: kills (name, ids in flight) and joins."""

    killed: list[tuple[str, list[str]]] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)


def _config(instances: dict[str, list[dict[str, Any]]], model: str) -> dict[str, Any]:
    return fewest_in_flight_config(instances, model, health={"interval": 1.0})


async def _one(client: httpx.AsyncClient, url: str, model: str, spec: ChurnSpec, n: int) -> Outcome:
    body = {
        "model": model,
        "prompt": [10 + (n * 7 + i) % 3000 for i in range(spec.prompt_tokens)],
        "max_tokens": spec.output_tokens,
        "stream": True,
    }
    request_id = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            request_id = response.headers.get("x-request-id")
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return Outcome(False, request_id, f"status {response.status_code}: {detail}")
            last = ""
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    last = line
            if last != "data: [DONE]":
                return Outcome(False, request_id, "stream ended without [DONE]")
            return Outcome(True, request_id)
    except httpx.HTTPError as exc:
        return Outcome(False, request_id, f"{type(exc).__name__}: {exc}"[:200])


async def _load(url: str, model: str, spec: ChurnSpec) -> list[Outcome]:
    rng = random.Random(spec.seed)
    timeout = httpx.Timeout(60.0, connect=5.0)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = []
        end = time.monotonic() + spec.seconds
        n = 0
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(_one(client, url, model, spec, n)))
            n += 1
            await asyncio.sleep(rng.expovariate(spec.rate))
        return list(await asyncio.gather(*tasks))


async def _churn(
    control: str, config_path: Path, router: ChildProcess, model: str, spec: ChurnSpec
) -> Churn:
    rng = random.Random(spec.seed + 1)
    done = Churn()
    end = time.monotonic() + spec.seconds
    leave = True
    async with httpx.AsyncClient(timeout=30.0) as client:
        while time.monotonic() < end:
            await asyncio.sleep(1.0)
            live = (await client.get(f"{control}/instances")).json()
            roles = [r for r in ("prefill", "decode") if len(live[r]) > spec.min_each]
            if leave and roles:
                victim = rng.choice(live[rng.choice(roles)])["name"]
                gone = (await client.delete(f"{control}/members/{victim}")).json()
                done.killed.append((victim, gone["in_flight"]))
            else:
                role = min(("prefill", "decode"), key=lambda r: len(live[r]))
                joined = (await client.post(f"{control}/members/{role}")).json()
                done.joined.append(joined["name"])
            leave = not leave
            live = (await client.get(f"{control}/instances")).json()
            config_path.write_text(yaml.safe_dump(_config(live, model)))
            assert router.pid is not None
            os.kill(router.pid, signal.SIGHUP)
    return done


def run_churn(spec: ChurnSpec, work: Path) -> dict[str, Any]:
    """Start, load and churn, stop; the outcome and the summary."""
    model = load_profile(spec.profile).model
    setup = FleetSetup(spec.size, spec.size, spec.profile)
    with fleet_behind_router(setup, partial(_config, model=model), work) as fleet:
        outcomes, churn = asyncio.run(_both(fleet, model, spec))
    return churn_result(spec, outcomes, churn)


async def _both(fleet: RunningFleet, model: str, spec: ChurnSpec) -> tuple[list[Outcome], Churn]:
    load = asyncio.create_task(_load(fleet.router_url, model, spec))
    churn = await _churn(fleet.control_url, fleet.config_path, fleet.router, model, spec)
    return await load, churn


def churn_result(spec: ChurnSpec, outcomes: list[Outcome], churn: Churn) -> dict[str, Any]:
    """The run's figures: a failure is explained when its request id was in flight on a killed
    instance."""
    killed_ids = {rid for _, ids in churn.killed for rid in ids}
    failed = [o for o in outcomes if not o.ok]
    explained = [o for o in failed if o.request_id in killed_ids]
    unexplained = [o for o in failed if o.request_id not in killed_ids]
    return {
        "spec": asdict(spec),
        "requests": len(outcomes),
        "completed": len(outcomes) - len(failed),
        "failed_on_killed_instances": len(explained),
        "kills": len(churn.killed),
        "joins": len(churn.joined),
        "requests_in_flight_at_kills": len(killed_ids),
        "unexplained": [asdict(o) for o in unexplained[:20]],
        "summary": {"churn_failed_requests": len(unexplained)},
    }
