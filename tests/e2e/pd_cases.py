"""The router's P/D cases, written once and run for every mode (push and pull).

A test module subclasses :class:`PDRouterCases` as ``Test...`` and provides a ``router`` fixture
(a :class:`e2e_support.RunningRouter` in front of a real vLLM CPU stack). Each case uses its own
prompts, so D never has them in its prefix cache and every request really transfers KV blocks.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.e2e.e2e_support import (
    MAX_TOKENS,
    Greedy,
    RunningRouter,
    assert_greedy_close,
    make_prompt,
    metrics,
    reference_greedy,
    reference_text,
    router_chat,
    router_completion,
    wait_idle,
)

TOP_LOGPROBS = 5

DISCONNECT_IDLE_TIMEOUT_S = 5.0


class PDRouterCases:
    """Greedy output through the router equals one aggregated instance, in every shape."""

    tag = "base"

    def _prompt(self, name: str) -> str:
        return make_prompt(f"{self.tag}-{name}")

    @pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
    def test_completion_equals_aggregated(self, router: RunningRouter, stream: bool) -> None:
        prompt = self._prompt(f"completion-{stream}")
        got = router_completion(router.client(), router.stack.model_name, prompt, stream)
        want = reference_text(router.stack.prefill[0], router.stack.model_name, prompt, False)
        assert want, "reference output is empty; the comparison would prove nothing"
        assert got == want

    @pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
    def test_chat_equals_aggregated(self, router: RunningRouter, stream: bool) -> None:
        prompt = self._prompt(f"chat-{stream}")
        got = router_chat(router.client(), router.stack.model_name, prompt, stream)
        want = reference_text(router.stack.prefill[0], router.stack.model_name, prompt, True)
        assert want
        assert got == want

    def test_usage_counts_prompt_from_prefill_and_completion_from_decode(
        self, router: RunningRouter
    ) -> None:
        prompt = self._prompt("usage")
        result = router.client().completions.create(
            model=router.stack.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        # The tokenizer's count for the prompt, from a plain request to vLLM's tokenizer.
        tokens = _tokenize(router, prompt)
        assert result.usage is not None
        assert result.usage.prompt_tokens == tokens
        assert result.usage.completion_tokens == MAX_TOKENS
        assert result.usage.total_tokens == tokens + MAX_TOKENS

    def test_eight_concurrent_requests_all_correct(self, router: RunningRouter) -> None:
        """Eight requests at once (half streamed) each get their own prompt's greedy answer.

        Concurrent requests are batched, and CPU kernels are not batch-invariant: on the tiny
        random-weight model, whose logits are nearly flat, a batch can flip a near-tie. So the
        answers are compared like vLLM's own tests compare logprobs: equal tokens up to the first
        difference, and there each side's token is among the other's top candidates (a request
        answered from another request's KV would differ far from any near-tie)."""
        model = router.stack.model_name
        prompts = [self._prompt(f"concurrent-{i}") for i in range(8)]

        async def one(client: Any, prompt: str, stream: bool) -> Greedy:
            kwargs = {
                "model": model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "logprobs": TOP_LOGPROBS,
            }
            if not stream:
                result = await client.completions.create(**kwargs)
                lp = result.choices[0].logprobs
                return Greedy(list(lp.tokens), [dict(t) for t in lp.top_logprobs])
            answer = Greedy([], [])
            chunks = await client.completions.create(**kwargs, stream=True)
            async with chunks:
                async for chunk in chunks:
                    for choice in chunk.choices:
                        if choice.logprobs is not None:
                            answer.tokens.extend(choice.logprobs.tokens)
                            answer.top.extend(dict(t) for t in choice.logprobs.top_logprobs)
            return answer

        async def all_of_them() -> list[Greedy]:
            async with router.async_client() as client:
                return await asyncio.gather(
                    *(one(client, p, i % 2 == 1) for i, p in enumerate(prompts))
                )

        got = asyncio.run(all_of_them())
        for i, (answer, prompt) in enumerate(zip(got, prompts, strict=True)):
            want = reference_greedy(router.stack.prefill[0], model, prompt, TOP_LOGPROBS)
            assert_greedy_close(answer, want, f"request {i}")

    def test_client_disconnect_mid_stream_leaves_decode_idle(self, router: RunningRouter) -> None:
        decode = router.stack.decode[0]
        prompt = self._prompt("disconnect")
        client = router.client()
        stream = client.completions.create(
            model=router.stack.model_name,
            prompt=prompt,
            max_tokens=4000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        received = 0
        for chunk in stream:
            received += sum(1 for choice in chunk.choices if choice.text)
            if received >= 5:
                break
        busy = metrics(decode)
        stream.close()
        assert received >= 5
        # D was really decoding when the client left (else the test would prove nothing).
        assert busy.get("vllm:num_requests_running", 0.0) == 1.0
        wait_idle(decode, DISCONNECT_IDLE_TIMEOUT_S, "D idle after the client disconnected")
        for prefill in router.stack.prefill:
            wait_idle(prefill, DISCONNECT_IDLE_TIMEOUT_S, f"{prefill.name} idle after it")

    def test_passthrough_routes_and_models_answer_as_vllm_does(self, router: RunningRouter) -> None:
        """/tokenize, /detokenize, a route the model does not serve and /v1/responses give what
        D gives when asked directly; /v1/models carries the instances' max_model_len."""
        model, d0 = router.stack.model_name, router.stack.decode[0].url
        tokenize = {"model": model, "prompt": self._prompt("tokenize")}
        tokens = _both(router, d0, "/tokenize", tokenize)["tokens"]
        _both(router, d0, "/detokenize", {"model": model, "tokens": tokens})
        _both(router, d0, "/v1/embeddings", {"model": model, "input": "x"})  # vLLM's 404
        responses = {"model": model, "input": "Say hi.", "max_output_tokens": 4, "temperature": 0}
        _both(router, d0, "/v1/responses", responses, compare=False)
        card = httpx.get(f"{router.url}/v1/models", timeout=30).json()["data"][0]
        direct = httpx.get(f"{d0}/v1/models", timeout=30).json()["data"][0]
        assert card["max_model_len"] == direct["max_model_len"] > 0
        listed = len(router.settings.routes()[model].decode.instances)
        assert card["pools"]["decode"] == {"instances": listed, "usable": listed}


def _both(
    router: RunningRouter, d0: str, path: str, body: dict[str, Any], compare: bool = True
) -> Any:
    """POST ``body`` to ``path`` through the router and to D directly: the same status (and,
    with ``compare``, the same JSON); the router's JSON."""
    via = httpx.post(router.url + path, json=body, timeout=120)
    direct = httpx.post(d0 + path, json=body, timeout=120)
    assert via.status_code == direct.status_code, (path, via.text, direct.text)
    if compare:
        assert via.json() == direct.json(), path
    return via.json()


def _tokenize(router: RunningRouter, prompt: str) -> int:
    import httpx

    response = httpx.post(
        router.stack.prefill[0].url + "/tokenize",
        json={"model": router.stack.model_name, "prompt": prompt},
        timeout=httpx.Timeout(30.0),
    )
    response.raise_for_status()
    count: int = response.json()["count"]
    return count
