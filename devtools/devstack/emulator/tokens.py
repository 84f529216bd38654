"""Token ids of a request's prompt, for an emulated engine.

Who uses it: :mod:`devstack.emulator.app` (every generation and ``/tokenize`` request). With a
tokenizer directory the ids are the router's own
(:class:`disagg_router.router.routing.block_keys.PromptTokenizer`, which renders and tokenizes as
vLLM does), so KV events name the blocks a KV-aware router computes for the same request. Without
one, a token-id prompt is taken as is and text is cut into one token per four UTF-8 bytes (the
router's estimate of a prompt's length): deterministic, so equal prefixes share blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg_router.router.routing.block_keys import PromptTokenizer, load_tokenizer
from disagg_router.router.routing.prompt_keys import render_messages

_CACHE_ENTRIES = 4096
_MAX_PROMPT_CHARS = 1 << 22


class Tokens:
    """Prompt -> token ids (one per engine, or shared by a fleet's engines)."""

    def __init__(self, tokenizer_dir: str | None = None) -> None:
        self._tokenizer = (
            PromptTokenizer(load_tokenizer(tokenizer_dir), _CACHE_ENTRIES, _MAX_PROMPT_CHARS)
            if tokenizer_dir
            else None
        )

    def of(self, body: Mapping[str, Any], chat: bool) -> list[int]:
        """The prompt's token ids (at least one)."""
        if self._tokenizer is not None:
            found = self._tokenizer.token_ids(body, chat)
            if found is not None:
                return found[0] or [0]
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return list(prompt) or [0]
        text = render_messages(body.get("messages") or []) if chat else str(prompt or "")
        return _byte_tokens(text.encode())


def _byte_tokens(data: bytes) -> list[int]:
    ids = [int.from_bytes(data[i : i + 4], "little") >> 1 for i in range(0, len(data), 4)]
    return ids or [0]
