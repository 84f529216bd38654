"""Our P and D leg bodies are accepted by vLLM 0.32's own request models (no engine started).

Importing vLLM (torch) takes 7 s on an idle machine and minutes on a loaded one, so this runs with
the real-vLLM suite (``vllm`` marker), not the fast suite. It catches rewrites that vLLM would
reject with a 400 (e.g. ``stream_options`` on the non-streamed P leg).
"""

from __future__ import annotations

from typing import Any

import pytest

from disagg_router.router.config import PushIdentity
from disagg_router.router.upstream.rewrite import decode_body_pull, decode_body_push, prefill_body

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

IDENT = PushIdentity(engine_id="e", host="127.0.0.1", port=5600)
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "max_completion_tokens": 20,
    "min_tokens": 5,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0,
}
COMPLETION = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 20,
    "min_tokens": 5,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.mark.parametrize(("body", "chat"), [(CHAT, True), (COMPLETION, False)])
def test_vllm_accepts_both_legs(body: dict[str, Any], chat: bool) -> None:
    vllm_protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    vllm_chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    model = vllm_chat.ChatCompletionRequest if chat else vllm_protocol.CompletionRequest
    p_leg = model.model_validate(prefill_body(body, chat, "t"))
    assert p_leg.stream is False
    params = p_leg.to_sampling_params(1, {})
    assert params.max_tokens == 1
    assert p_leg.kv_transfer_params["do_remote_decode"] is True
    d_push = model.model_validate(decode_body_push(body, IDENT, "r", "t"))
    assert d_push.kv_transfer_params["remote_engine_id"] == "e"
    assert d_push.to_sampling_params(20, {}).min_tokens == 5
    d_pull = model.model_validate(decode_body_pull(body, {"remote_engine_id": "e"}, "t"))
    assert d_pull.stream is True
