"""The block keys of a request: its prompt's token ids, cut into KV cache blocks, chain-hashed.

Who calls it: :mod:`disagg_router.router.routing.kv_routing`, once per request that a ``kv_aware``
pool routes (the keys are kept for the P and the D choice), and
:mod:`disagg_router.router.routing.kv_index` for every block a ``BlockStored`` event reports. Both
sides use :func:`chain_keys`, so a request's key ``i`` equals an indexed key exactly when the
instance holds the same first ``(i + 1) * block_size`` tokens: exact prefix matching on tokens.

The keys are the router's own, not vLLM's block hashes: vLLM's hash depends on its
``prefix_caching_hash_algo`` and on ``PYTHONHASHSEED`` (which seeds ``NONE_HASH``; the ``xxhash``
algorithms use a random seed per process without it), while the token ids a ``BlockStored``
event carries do not. The index maps each instance's vLLM hashes to these keys (a removal names
only vLLM's hash). See docs/router.md, "KV-aware routing".

:class:`PromptTokenizer` renders and tokenizes like vLLM's OpenAI server: a chat request through
the model's chat template with ``add_generation_prompt`` (default true) and no added special
tokens (default), a completion with added special tokens (default true), a token-id prompt as
is. A request using anything else that changes vLLM's tokens (tools, a request chat template,
non-text content parts) gets no keys, and the policy falls back to approximate routing. The
tokenizer is loaded from a local directory only (never the network). Tokenizing costs CPU on the
request path (docs/router.md gives the measured cost): prompts are cached (LRU,
``tokenize_cache_entries``), a chat piece by piece (:class:`PromptTokenizer`), and text longer
than ``max_prompt_chars`` is cut (the keys of the last two blocks before the cut are dropped,
since a cut can change the tokens at its end).
"""

from __future__ import annotations

import hashlib
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

ROOT_KEY = bytes(16)
"""The parent of every chain's first block."""

_UNSUPPORTED_CHAT_FIELDS = (
    "tools",
    "chat_template",
    "continue_final_message",
    "mm_processor_kwargs",
)


def chain_keys(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_KEY) -> list[bytes]:
    """The keys of the full blocks of ``token_ids``: key ``i`` hashes key ``i - 1`` (``parent``
    for the first) and block ``i``'s token ids. A trailing partial block has no key."""
    keys = []
    key = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = array("I", token_ids[start : start + block_size]).tobytes()
        key = hashlib.blake2b(key + block, digest_size=16).digest()
        keys.append(key)
    return keys


class _Tokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def get_added_vocab(self) -> dict[str, int]: ...


def load_tokenizer(path: str) -> _Tokenizer:
    """The Hugging Face tokenizer in the local directory ``path`` (no download). Slow: call it
    off the event loop, once per model and config."""
    from transformers import AutoTokenizer  # imported only when KV-aware routing is configured

    tokenizer: _Tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tokenizer


def _chat_messages(body: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """The messages with text content only, as vLLM passes them to the template; None if a
    message has anything else (the router then cannot reproduce vLLM's tokens)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or any(body.get(f) for f in _UNSUPPORTED_CHAT_FIELDS):
        return None
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return None
        if set(message) - {"role", "content", "name"}:
            return None
        out.append(dict(message))
    return out


class _Lru:
    """A bounded map, least recently used entry out first."""

    def __init__(self, entries: int) -> None:
        self._entries = entries
        self._data: OrderedDict[Any, list[int]] = OrderedDict()

    def get(self, key: Any) -> list[int] | None:
        found = self._data.get(key)
        if found is not None:
            self._data.move_to_end(key)
        return found

    def put(self, key: Any, value: list[int]) -> None:
        self._data[key] = value
        if len(self._data) > self._entries:
            self._data.popitem(last=False)


class PromptTokenizer:
    """Token ids of a request's prompt as vLLM computes them; see the module docstring.

    A rendered chat is tokenized piecewise: a tokenizer splits its input at its added (special)
    tokens before anything else, so the pieces between them (a system prompt, one turn) are
    tokenized and cached alone, and a conversation's next turn costs only its new pieces. The
    first ``VERIFY_FIRST`` chats are also tokenized whole; if a piecewise result ever differs
    (added tokens that strip whitespace around them, say), piecewise tokenizing is switched off
    for good and the whole-prompt cache alone serves.
    """

    VERIFY_FIRST = 32

    def __init__(self, tokenizer: _Tokenizer, cache_entries: int, max_prompt_chars: int) -> None:
        self._tokenizer = tokenizer
        self._cache = _Lru(cache_entries)
        self._pieces = _Lru(cache_entries * 4)
        self._max_chars = max_prompt_chars
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        self._added = {t: i for t, i in added.items() if t}
        alternatives = "|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})") if alternatives else None
        self._verify_left = self.VERIFY_FIRST

    def token_ids(self, body: Mapping[str, Any], chat: bool) -> tuple[list[int], bool] | None:
        """``(token ids, cut)`` of the prompt (``cut``: text beyond ``max_prompt_chars`` was left
        out), or None when the request's tokens cannot be reproduced here."""
        if chat:
            messages = _chat_messages(body)
            if messages is None:
                return None
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                return None
            text = self._tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                **kwargs,
            )
            special = body.get("add_special_tokens", False) is True
            if not special and isinstance(text, str) and len(text) <= self._max_chars:
                return self._encode_pieces(text), False
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return list(prompt), False
            if not isinstance(prompt, str):
                return None
            text = prompt
            special = body.get("add_special_tokens", True) is not False
        if not isinstance(text, str):
            return None
        cut = len(text) > self._max_chars
        return self._encode(text[: self._max_chars], special), cut

    def _encode(self, text: str, special: bool) -> list[int]:
        key = (special, text)
        ids = self._cache.get(key)
        if ids is None:
            ids = list(self._tokenizer.encode(text, add_special_tokens=special))
            self._cache.put(key, ids)
        return ids

    def _encode_pieces(self, text: str) -> list[int]:
        """``text`` (no added special tokens) tokenized piece by piece; see the class doc."""
        if self._split is None:
            return self._encode(text, False)
        ids: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            added = self._added.get(piece)
            if added is not None:
                ids.append(added)
                continue
            found = self._pieces.get(piece)
            if found is None:
                found = list(self._tokenizer.encode(piece, add_special_tokens=False))
                self._pieces.put(piece, found)
            ids += found
        if self._verify_left > 0:
            self._verify_left -= 1
            whole = self._encode(text, False)
            if whole != ids:
                log.warning("piecewise tokenizing differs from whole-prompt tokenizing; off")
                self._split = None
                return whole
        return ids


def request_keys(
    tokenizer: PromptTokenizer, body: Mapping[str, Any], chat: bool, block_size: int
) -> tuple[int, list[bytes]] | None:
    """``(prompt tokens, keys of the blocks vLLM could find cached)``, or None (no keys).

    vLLM computes at least the prompt's last token, so a cache hit covers at most
    ``(tokens - 1) // block_size`` blocks; only those are keyed."""
    found = tokenizer.token_ids(body, chat)
    if found is None:
        return None
    ids, cut = found
    usable = (len(ids) - 1) // block_size
    if cut:
        usable = max(0, len(ids) // block_size - 2)
    return len(ids), chain_keys(ids[: usable * block_size], block_size)
