"""Binding D late (push.bind): one event loop over scripted P and D instances (real HTTP). P's
pace is taught through its public state, so the prediction is known; what is asserted is the
order of the legs at the instances and which D served, never how long anything took."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import pytest

from devstack.fakes.server import UvicornThread
from disagg_router.router.config import settings_from_mapping
from disagg_router.router.dispatch.binding import kv_scarce
from disagg_router.router.dispatch.orchestrator import open_dispatch
from disagg_router.router.errors import RouterError
from disagg_router.router.instances.pace import MIN_SAMPLES
from disagg_router.router.instances.state import BackendState, LoadSignals
from disagg_router.router.request import ClientRequest
from disagg_router.router.runtime import Runtime, open_runtime
from tests.support.scripted import scripted
from tests.unit.router.mock_upstream import KV, answer

IDENTITY = {"engine_id": "eng", "host": "127.0.0.1", "port": 5600}
PROMPT = "a long prompt " * 20  # 70 tokens at the default 4 characters per token
REQUEST = ClientRequest(
    body={"model": "m", "prompt": PROMPT, "max_tokens": 2}, chat=False, stream=False, model="m"
)


class Script:
    """1P2D: what reached P and D, in order, and when P may answer."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.p_may_answer: Callable[[], bool] = lambda: True
        self.p_status = 200
        self.d_port0 = 0

    async def upstream(self, request: httpx.Request) -> httpx.Response:
        kv = json.loads(request.content)["kv_transfer_params"]
        if not kv.get("do_remote_decode"):  # a D leg
            self.order.append(f"D{0 if request.url.port == self.d_port0 else 1}")
            return httpx.Response(200, json=answer("a", None))
        self.order.append("P start")
        await until(self.p_may_answer)
        self.order.append("P end")
        if self.p_status != 200:
            return httpx.Response(self.p_status, json={"error": {"message": "engine failed"}})
        return httpx.Response(200, json=answer("a", KV))


async def until(condition: Callable[[], bool]) -> None:
    while not condition():  # polls what the router or the test did, bounded by the test
        await asyncio.sleep(0.01)


@contextmanager
def one_p_two_d(script: Script) -> Iterator[list[UvicornThread]]:
    with scripted(script.upstream, 3) as servers:
        script.d_port0 = servers[1].port
        yield servers


def settings(urls: list[str], bind: str, **more: Any) -> Any:
    return settings_from_mapping(
        {
            "models": ["m"],
            "prefill": {"instances": [{"url": urls[0], "identity": IDENTITY}]},
            "decode": {"instances": [{"url": url} for url in urls[1:]], "policy": "round_robin"},
            "push": {"bind": bind},
            **more,
        }
    )


@asynccontextmanager
async def runtime_for(servers: list[UvicornThread], bind: str, **more: Any) -> Any:
    async with open_runtime(settings([s.url for s in servers], bind, **more)) as runtime:
        yield runtime
        counts = [(b.in_flight, b.gate.in_use) for b in runtime.backends()]
        assert counts == [(0, 0)] * 3  # every count and slot given back


def teach(runtime: Runtime, seconds_per_token: float) -> None:
    """P's pace as if it had answered ``MIN_SAMPLES`` prefills at that speed, long ago."""
    pace = runtime.pools[0].backends[0].pace.prefill
    start = time.monotonic() - 10_000.0
    for _ in range(MIN_SAMPLES):
        ticket = pace.send(100, start)
        start += 100 * seconds_per_token
        pace.done(ticket, start, answered=True)


def binds(runtime: Runtime, reason: str) -> float | None:
    return runtime.metrics.registry.get_sample_value(
        "disagg_router_decode_binds_total", {"reason": reason}
    )


async def test_eager_sends_d_at_once_to_the_d_chosen_on_arrival() -> None:
    script = Script()
    released = False
    script.p_may_answer = lambda: released
    with one_p_two_d(script) as servers:
        async with runtime_for(servers, "eager") as runtime:
            task = asyncio.create_task(open_dispatch(runtime, REQUEST))
            await until(lambda: "D0" in script.order)  # P still prefilling
            released = True
            dispatch = await task
            await until(lambda: "P end" in script.order)
            await dispatch.close()
            assert binds(runtime, "eager") == 1.0
    assert script.order[-1] == "P end"


async def test_just_in_time_binds_when_p_finishes_first_and_chooses_d_then() -> None:
    """P is predicted to take hours: D is bound when P's answer comes, and it is chosen then:
    D0, round robin's first choice on arrival, was taken out meanwhile."""
    script = Script()
    released = False
    script.p_may_answer = lambda: released
    with one_p_two_d(script) as servers:
        async with runtime_for(servers, "just_in_time") as runtime:
            teach(runtime, seconds_per_token=100.0)
            task = asyncio.create_task(open_dispatch(runtime, REQUEST))
            await until(lambda: "P start" in script.order)
            d0 = runtime.pools[1].backends[0]
            d0.healthy = False
            released = True
            dispatch = await task
            await dispatch.close()
            assert binds(runtime, "prefill_done") == 1.0
    assert script.order == ["P start", "P end", "D1"]


async def test_just_in_time_sends_d_ahead_of_ps_predicted_finish() -> None:
    """P answers only once D's leg has come: D must be sent on the prediction (70 tokens at
    10 ms: 0.7 s) less its lead (0.25 s + 0.02 s), before P finishes."""
    script = Script()
    script.p_may_answer = lambda: any(e.startswith("D") for e in script.order)
    with one_p_two_d(script) as servers:
        async with runtime_for(servers, "just_in_time") as runtime:
            teach(runtime, seconds_per_token=0.01)
            dispatch = await asyncio.wait_for(open_dispatch(runtime, REQUEST), timeout=30)
            await until(lambda: "P end" in script.order)
            await dispatch.close()
            assert binds(runtime, "predicted") == 1.0
            late = runtime.metrics.registry.get_sample_value(
                "disagg_router_bind_delay_seconds_count", {"bind": "just_in_time"}
            )
            assert late == 1.0
    assert sorted(script.order) == ["D0", "P end", "P start"]  # P answers once D came
    assert script.order[-1] == "P end"


async def test_an_unlearned_p_binds_d_at_once() -> None:
    script = Script()
    script.p_may_answer = lambda: any(e.startswith("D") for e in script.order)
    with one_p_two_d(script) as servers:
        async with runtime_for(servers, "just_in_time") as runtime:
            dispatch = await asyncio.wait_for(open_dispatch(runtime, REQUEST), timeout=30)
            await until(lambda: "P end" in script.order)
            await dispatch.close()
            assert binds(runtime, "unlearned") == 1.0
            assert runtime.pools[0].backends[0].pace.prefill.learned is False  # 1 of 3
    assert sorted(script.order) == ["D0", "P end", "P start"]  # P answers once D came
    assert script.order[-1] == "P end"


@pytest.mark.parametrize("window", ["P fails", "client leaves"])
async def test_nothing_is_bound_or_left_held_when_the_request_ends_before_d_is_due(
    window: str,
) -> None:
    """P fails, or the client goes away, while D is not bound yet: no D leg is ever sent and
    every count and slot is given back (checked on leaving ``runtime_for``)."""
    script = Script()
    released = False
    script.p_may_answer = lambda: released
    script.p_status = 500
    with one_p_two_d(script) as servers:
        async with runtime_for(servers, "just_in_time", retry_on_fresh_pair=False) as runtime:
            teach(runtime, seconds_per_token=100.0)
            task = asyncio.create_task(open_dispatch(runtime, REQUEST))
            await until(lambda: "P start" in script.order)
            if window == "client leaves":
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                released = True
                with pytest.raises(RouterError):
                    await task
            assert binds(runtime, "prefill_done") is None
    assert not any(e.startswith("D") for e in script.order)


def _with_kv_usage(backend: BackendState, usage: float, kv_tokens: int = 0) -> None:
    backend.signals = LoadSignals(0.0, 1.0, usage, time.monotonic(), kv_tokens=kv_tokens)


@pytest.mark.parametrize(
    ("usages", "late"),
    [((0.9, 0.95), True), ((0.2, 0.3), False), ((None, None), False), ((0.2, 0.9), True)],
)
def test_adaptive_binds_late_once_one_d_reports_its_kv_scarce(
    usages: tuple[float | None, float | None], late: bool
) -> None:
    config = settings([f"http://127.0.0.1:{9400 + i}" for i in range(3)], "adaptive")
    decodes = [BackendState(instance, "decode") for instance in config.decode.instances]
    for backend, usage in zip(decodes, usages, strict=True):
        if usage is not None:
            _with_kv_usage(backend, usage)
    assert kv_scarce(config, decodes, in_flight=0, tokens=0) is late


@pytest.mark.parametrize(
    ("sizes", "in_flight", "tokens", "late"),
    [
        ((1000, 1000), 0, 100, False),
        ((1000, 1000), 799, 100, False),
        ((1000, 1000), 800, 100, True),
        ((1000, 600), 0, 499, False),
        ((1000, 600), 0, 500, True),
        ((0, 0), 10**9, 10**9, False),
    ],
)
def test_adaptive_weighs_the_requests_in_flight_and_the_prompt_against_the_ds_kv(
    sizes: tuple[int, int], in_flight: int, tokens: int, late: bool
) -> None:
    """Gauges at zero (bound just in time, nothing is registered yet): the prompts in flight,
    as a share of all Ds' KV, and this prompt, as a share of the largest D's, decide against
    half (the default threshold); unreported sizes leave the gauges alone to decide."""
    config = settings([f"http://127.0.0.1:{9400 + i}" for i in range(3)], "adaptive")
    decodes = [BackendState(instance, "decode") for instance in config.decode.instances]
    for backend, size in zip(decodes, sizes, strict=True):
        _with_kv_usage(backend, 0.0, kv_tokens=size)
    assert kv_scarce(config, decodes, in_flight, tokens) is late


async def test_adaptive_binds_late_while_the_requests_in_flight_would_fill_half_the_kv() -> None:
    """Each D reports 200 tokens of KV and an empty cache; a prompt is 70 tokens. The first
    request (70 of 200 on one D) binds eagerly; the second, while the first is in flight
    (70 of 400 in flight, plus 70 of 200), binds late although the gauges still say empty;
    every token is given back at the close."""
    script = Script()
    released = False
    script.p_may_answer = lambda: released
    with one_p_two_d(script) as servers:
        async with runtime_for(servers, "adaptive") as runtime:
            decodes = runtime.pools[1]
            for backend in decodes.backends:
                _with_kv_usage(backend, 0.0, kv_tokens=200)
            first = asyncio.create_task(open_dispatch(runtime, REQUEST))
            await until(lambda: "D0" in script.order)  # eager: D0's leg went out with P's
            assert decodes.kv_demand.tokens == 70
            second = asyncio.create_task(open_dispatch(runtime, REQUEST))
            await until(lambda: script.order.count("P start") == 2)
            assert decodes.kv_demand.tokens == 140
            released = True
            for dispatch in await asyncio.gather(first, second):
                await dispatch.close()
            assert (binds(runtime, "eager"), binds(runtime, "unlearned")) == (1.0, 1.0)
            assert decodes.kv_demand.tokens == 0
