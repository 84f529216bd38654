"""What routing reads from a request's prompt: a prefix key, a session key, a length estimate.

Who calls it: the policies (:mod:`disagg_router.router.routing.policies.base`,
:mod:`disagg_router.router.routing.policies.prefix_affinity`,
:mod:`disagg_router.router.routing.policies.session_affinity`) and the conditional disaggregation
rule (:mod:`disagg_router.router.dispatch.orchestrator`). Pure functions of the validated request
body; no I/O.

Rendering: a completions prompt is its text (or its token ids); a chat request renders its
messages in order with system (and developer) messages first, each as ``role``, a unit separator
and its text content, closed by a record separator. Two requests with the same leading messages
thus share the leading characters of their rendering, as they share the leading tokens of vLLM's
chat template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_FIRST_ROLES = ("system", "developer")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(parts)
    return "" if content is None else json.dumps(content, sort_keys=True)


def render_messages(messages: list[Any]) -> str:
    """Chat messages as one string: system/developer messages first, then the rest in order."""
    first = [m for m in messages if isinstance(m, dict) and m.get("role") in _FIRST_ROLES]
    rest = [m for m in messages if not (isinstance(m, dict) and m.get("role") in _FIRST_ROLES)]
    out = []
    for m in first + rest:
        role = m.get("role", "") if isinstance(m, dict) else ""
        content = m.get("content") if isinstance(m, dict) else m
        out.append(f"{role}\x1f{_content_text(content)}\x1e")
    return "".join(out)


def prompt_of(body: Mapping[str, Any], chat: bool) -> str | list[int]:
    """The prompt as routing sees it: rendered text, or the token ids of a token prompt."""
    if chat:
        messages = body.get("messages")
        return render_messages(messages if isinstance(messages, list) else [])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    # One pass in C over the element types (not an isinstance call per token id).
    if isinstance(prompt, list) and all(issubclass(t, int) for t in set(map(type, prompt))):
        return list(prompt)
    return ""


def prefix_key(prompt: str | list[int], prefix_chars: int) -> bytes:
    """The bytes ``prefix_affinity`` hashes: the first ``prefix_chars`` characters of the
    prompt (token ids: the first ``prefix_chars // 4``, about as many tokens)."""
    if isinstance(prompt, str):
        return prompt[:prefix_chars].encode()
    head = prompt[: max(prefix_chars // 4, 1)]
    return b"ids:" + b",".join(str(t).encode() for t in head)


def estimated_tokens(prompt: str | list[int], chars_per_token: float) -> int:
    """Prompt length in tokens: exact for token ids, ``len(text) / chars_per_token`` for text."""
    if isinstance(prompt, list):
        return len(prompt)
    return int(len(prompt) / chars_per_token)


def session_key(headers: Mapping[str, str], body: Mapping[str, Any], header: str) -> str | None:
    """The session: the ``header`` value (case-insensitive), else the body's string ``user``."""
    value = headers.get(header.lower())
    if value:
        return value
    user = body.get("user")
    return user if isinstance(user, str) and user else None
