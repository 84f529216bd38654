"""Block keys of requests, with the tiny model's tokenizer and chat template (``transformers``,
and ``torch`` to make the model: the suites with vLLM installed), against the prompt token ids a
real vLLM computed (tests/unit/router/recorded/vllm_kv_events.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from disagg_router.router.routing.block_keys import (
    PromptTokenizer,
    chain_keys,
    load_tokenizer,
    request_keys,
)

RECORDING = Path(__file__).parent / "router" / "recorded" / "vllm_kv_events.json"


def _recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDING.read_text())
    return data


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    from devstack.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    return PromptTokenizer(load_tokenizer(str(model)), cache_entries=8, max_prompt_chars=65536)


def test_the_router_tokenizes_every_recorded_request_as_vllm_did(
    tiny_tokenizer: PromptTokenizer,
) -> None:
    for request in _recording()["requests"]:
        chat = request["path"].endswith("/chat/completions")
        found = tiny_tokenizer.token_ids(request["body"], chat)
        assert found is not None
        assert found[0] == request["prompt_token_ids"], request["path"]


def test_request_keys_stop_before_the_block_of_the_last_token(
    tiny_tokenizer: PromptTokenizer,
) -> None:
    ids = list(range(1, 257))  # exactly two blocks of 128: the last token is computed anyway
    found = request_keys(tiny_tokenizer, {"prompt": ids}, False, 128)
    assert found == (256, chain_keys(ids[:128], 128))


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
        {"messages": "not a list"},
    ],
)
def test_requests_whose_tokens_cannot_be_reproduced_get_no_keys(
    tiny_tokenizer: PromptTokenizer, body: dict[str, Any]
) -> None:
    assert tiny_tokenizer.token_ids(body, chat=True) is None
