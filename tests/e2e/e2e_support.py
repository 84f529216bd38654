"""Helpers for the real-vLLM end-to-end suite: prompts, reference outputs, a running router.

The reference ("aggregated") output of a prompt is a plain request, without
``kv_transfer_params``, straight to a prefill instance: vLLM then serves it like any aggregated
instance (``test_e2e_pull.py`` checks this against an instance started without a KV connector).
References are never taken from D, so D's prefix cache only ever holds what came through P/D.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from devstack.fake_vllm import UvicornThread
from devstack.stack import Stack, StackInstance, StackOptions, start_stack
from devstack.vllm_server import read_metrics_text
from disagg_router.router.config import RouterSettings, settings_from_mapping
from disagg_router.router.http.app import create_app
from disagg_router.router.http.protocol import protocol_class
from tests.support.wait import wait_until

MAX_TOKENS = 24
READY_TIMEOUT_S = 120.0
_WORDS = ("river", "city", "garden", "music", "paper", "window", "light", "water", "stone")
_WORDS += ("cloud", "tree", "house", "market", "school", "number", "letter", "green", "blue")
_WORDS += ("red", "yellow", "alpha", "beta", "gamma", "delta", "seven", "eight", "nine", "ten")


def make_prompt(tag: str, words: int = 300) -> str:
    """A deterministic prompt of roughly ``words`` words (a few hundred tokens), unique per tag.

    Lengths are deliberately not multiples of the KV block size, and every prompt spans several
    blocks, so a transfer that drops or misplaces blocks changes the output.
    """
    rng = random.Random(tag)
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"{tag}: {body}"


def reference_text(instance: StackInstance, model: str, prompt: str, chat: bool) -> str:
    """Greedy output of one aggregated request (no kv_transfer_params) sent straight to vLLM."""
    body: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    response = httpx.post(instance.url + path, json=body, timeout=httpx.Timeout(120.0))
    response.raise_for_status()
    choice = response.json()["choices"][0]
    text: str = choice["message"]["content"] if chat else choice["text"]
    return text


@dataclass
class Greedy:
    """A greedy answer as tokens, with each position's top candidates (token -> logprob)."""

    tokens: list[str]
    top: list[dict[str, float]]


def reference_greedy(instance: StackInstance, model: str, prompt: str, top: int) -> Greedy:
    """Greedy tokens and top-``top`` candidates of one request straight to an instance."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": top,
    }
    response = httpx.post(instance.url + "/v1/completions", json=body, timeout=httpx.Timeout(120.0))
    response.raise_for_status()
    lp = response.json()["choices"][0]["logprobs"]
    return Greedy(list(lp["tokens"]), [dict(t) for t in lp["top_logprobs"]])


def assert_greedy_close(got: Greedy, want: Greedy, what: str) -> None:
    """Equal tokens up to the first difference; there, each token is a top candidate of the
    other side (a near-tie flipped by batching), after which the sequences may differ."""
    assert len(got.tokens) == len(want.tokens) == MAX_TOKENS, what
    for i, (g, w) in enumerate(zip(got.tokens, want.tokens, strict=True)):
        if g != w:
            assert g in want.top[i] and w in got.top[i], (what, i, got.tokens, want.tokens)
            return


def metrics(instance: StackInstance) -> dict[str, float]:
    """``/metrics`` of an instance, samples summed over labels."""
    response = httpx.get(instance.url + "/metrics", timeout=httpx.Timeout(10.0))
    response.raise_for_status()
    return read_metrics_text(response.text)


def kv_blocks(instance: StackInstance) -> int:
    """KV blocks in use on ``instance`` (usage fraction x its number of blocks)."""
    text = httpx.get(f"{instance.url}/metrics", timeout=10).text
    usage = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    total = re.search(r'num_gpu_blocks="(\d+)"', text)
    if usage is None or total is None:
        raise AssertionError(f"{instance.name}: no KV usage in /metrics")
    return round(float(usage.group(1)) * int(total.group(1)))


def load(instance: StackInstance) -> tuple[float, float]:
    """(running, waiting) requests of an instance, from its ``/metrics``."""
    values = metrics(instance)
    running = values.get("vllm:num_requests_running", -1.0)
    return running, values.get("vllm:num_requests_waiting", -1.0)


def wait_idle(instance: StackInstance, timeout_s: float, what: str) -> None:
    """Wait until the instance reports 0 running and 0 waiting requests; fail with ``what``."""
    wait_until(lambda: load(instance) == (0.0, 0.0), timeout=timeout_s, what=what, interval=0.25)


@dataclass
class RunningRouter:
    """A router app served in-process on a free loopback port, in front of a real stack."""

    stack: Stack
    settings: RouterSettings
    server: UvicornThread

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, max_retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key="unused",
            max_retries=max_retries,
            timeout=httpx.Timeout(180.0),
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key="unused",
            max_retries=0,
            timeout=httpx.Timeout(180.0),
        )


@contextmanager
def running_router(
    stack: Stack, overrides: dict[str, dict[str, Any]] | None = None, **config_kwargs: Any
) -> Iterator[RunningRouter]:
    """Serve a router for ``stack`` and wait until its ``/ready`` answers 200.

    ``overrides``: per top-level section, keys merged into the stack's router config (e.g.
    ``{"prefill": {"prefix_chars": 512}, "disaggregation": {"min_prompt_tokens": 4096}}``).
    """
    config = stack.router_config(**config_kwargs)
    for section, values in (overrides or {}).items():
        config[section] = {**config.get(section, {}), **values}
    # A loaded 2-core machine answers probes slowly; do not flap backends in the suite.
    timeouts = config.setdefault("timeouts", {})
    timeouts.setdefault("health", 60.0)
    # > P's 30 s lease: a stalled pair fails, not hangs; and above what 8 concurrent pull
    # requests through vLLM's NixlConnector (busy progress threads on both cores) take to their
    # first tokens on a slow day, which can pass 75 s.
    timeouts.setdefault("first_token", 150.0)
    settings = settings_from_mapping(config)
    # The router's own server protocol, as `serve` runs it (D's streams spliced to clients).
    server = UvicornThread(create_app(settings), http=protocol_class(settings.limits))
    server.start()
    try:
        wait_until(
            lambda: _ready(server.url),
            timeout=READY_TIMEOUT_S,
            what="the router's /ready",
            interval=0.5,
        )
        yield RunningRouter(stack=stack, settings=settings, server=server)
    finally:
        server.stop()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=httpx.Timeout(10.0)).status_code == 200
    except httpx.TransportError:
        return False


def router_completion(client: openai.OpenAI, model: str, prompt: str, stream: bool) -> str:
    """Greedy completion through the router (openai SDK), streamed or not; the text."""
    if not stream:
        result = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return result.choices[0].text
    parts: list[str] = []
    with client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    ) as chunks:
        for chunk in chunks:
            parts.extend(choice.text for choice in chunk.choices)
    return "".join(parts)


def router_chat(client: openai.OpenAI, model: str, prompt: str, stream: bool) -> str:
    """Greedy chat completion through the router (openai SDK), streamed or not; the content."""
    messages: list[Any] = [{"role": "user", "content": prompt}]
    if not stream:
        result = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        return result.choices[0].message.content or ""
    parts: list[str] = []
    with client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    ) as chunks:
        for chunk in chunks:
            parts.extend(choice.delta.content or "" for choice in chunk.choices)
    return "".join(parts)


@contextmanager
def module_stack(options: StackOptions, work_dir: Path) -> Iterator[Stack]:
    """Start a stack for one module, warm every instance up, stop it afterwards."""
    stack = start_stack(options, work_dir)
    print(f"\nstarted {options.kind} {options.topology} stack:\n{stack.describe()}")
    try:
        # A fresh instance's first large prefill is very slow; keep it out of router timeouts.
        print(f"warm-up seconds per instance: {stack.warm_up()}")
        yield stack
    finally:
        stack.stop()
