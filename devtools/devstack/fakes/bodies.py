"""The body of a whole (non-streamed) OpenAI completion or chat answer, as vLLM's server writes
it: one builder for the fake vLLM and the emulator.

Who calls it: :mod:`devstack.fakes.vllm_app` and :mod:`devstack.emulator.app`.
"""

from __future__ import annotations

import time
from typing import Any

from disagg_router.connector.contract import KV_TRANSFER_PARAMS


def whole_answer(
    *,
    answer_id: str,
    chat: bool,
    model: str,
    text: str,
    usage: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
    created: int | None = None,
) -> dict[str, Any]:
    """vLLM's answer body with one choice that stopped at its length limit."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    else:
        choice["text"] = text
    choice["stop_reason"] = None
    return {
        "id": answer_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [choice],
        "usage": usage,
        "system_fingerprint": None,
        KV_TRANSFER_PARAMS: kv_transfer_params,
    }
