"""One client stream made of several D streams: what a migration needs to know and rewrite.

Who calls it: :mod:`disagg_router.router.dispatch.migration`, which asks :func:`ineligible`
before a streamed request is opened, has D send token ids (:func:`asking_ids`), passes every
event of every D stream through :meth:`StreamJoin.event`, and builds the request that continues
the stream on another D with :meth:`StreamJoin.continuation`. Pure: no I/O, no clock.

The first D's stream carries the prompt's token ids (first chunk) and each chunk's generated ids
(vLLM's ``return_token_ids``). The continuation asks for the rest of the answer with exactly those
ids as its prompt (a completion: ``prompt`` as ids; a chat: vLLM's
``kv_transfer_params.prompt_token_ids``, so the chat template is not rendered again and the tool
and reasoning parsers still run), ``max_tokens`` and ``min_tokens`` reduced by what was sent. The
client sees one stream: the first response's ``id`` and ``created`` throughout, no second role
delta, no token ids unless it asked for them, usage counting the prompt once and every generated
token once, the finish reason of the D that finished.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from disagg_router.router.request import ClientRequest

RETURN_TOKEN_IDS = "return_token_ids"
_IDS = b'"token_ids":['
_NO_PROMPT_IDS = b',"prompt_token_ids":null'
_JUDGED = re.compile(rb'"(?:prompt_token_ids":\[|tool_calls"|delta":\{\}|token_ids":null)')
"""What :meth:`StreamJoin.plain_event` leaves to the parsed path: the prompt's ids, a tool
call, an empty delta, a token without its id (one search for the four, as it runs per token)."""


_LIMITS = ("max_tokens", "max_completion_tokens")
_INT = {int}


@dataclass(frozen=True)
class JoinRules:
    """What may be continued: ``seeded`` also a request with a ``seed`` (the new D cannot go on
    with the seed's random sequence, so the text after the seam differs from one run's)."""

    seeded: bool = False


def ineligible(request: ClientRequest, rules: JoinRules) -> str | None:
    """Why ``request`` cannot be continued on another D (None: it can).

    Streams only, one choice, no echo or beam search, a seed only when ``rules`` allow it, one
    prompt (a completion's string or token ids; a chat's messages of text only: vLLM renders
    media again instead of taking the ids)."""
    body = request.body
    if not request.stream:
        return "not streamed"
    if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
        return "several choices"
    if body.get("echo") or body.get("use_beam_search"):
        return "echo or beam search"
    if body.get("seed") is not None and not rules.seeded:
        return "seeded sampling"
    if request.chat:
        return None if _text_only(body.get("messages")) else "non-text content"
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _ids(prompt):
        return None
    return "several prompts"


def _text_only(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            return False
    return True


def _produced(choice: dict[str, Any]) -> bool:
    """Whether a choice carries anything for the client: generated output, a role, logprobs,
    a finish."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") or _generated(choice):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("role"))


def _generated(choice: dict[str, Any]) -> bool:
    """Whether a choice carries generated output (text, content, reasoning, a tool call): the
    tokens its ``token_ids`` must name."""
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    return any(v not in (None, "", []) for k, v in delta.items() if k != "role")


def _ids(value: Any) -> bool:
    """A non-empty list of ints (a prompt's ids): its element types gathered in C, as a
    prompt can hold thousands."""
    return isinstance(value, list) and bool(value) and set(map(type, value)) == _INT


def asking_ids(request: ClientRequest) -> ClientRequest:
    """``request`` asking D for token ids (the join strips them unless the client asked)."""
    if request.body.get(RETURN_TOKEN_IDS) is True:
        return request
    return replace(request, body={**request.body, RETURN_TOKEN_IDS: True})


class StreamJoin:
    """The state of one client stream across its D streams (see the module docstring).

    ``client_ids``: the client asked for token ids itself (they are then left in)."""

    def __init__(self, client_ids: bool) -> None:
        self._client_ids = client_ids
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.segment = 0  # 0: the first D's stream; n: the n-th continuation's
        self._base = 0  # tokens generated before this segment
        self._id: Any = None
        self._created: Any = None
        self._complete = True  # every generated token came with its id
        self._tool_call = False
        self.usage: Any = None  # the last usage the client got

    def resumable(self) -> bool:
        """Whether the stream so far can be continued exactly (:meth:`why_not` says why not)."""
        return self.why_not() is None

    def why_not(self) -> str | None:
        """Why the stream so far cannot be continued exactly (None: it can): the prompt's and
        every generated token's id must be known, and no tool call begun (its parser state
        would not carry over)."""
        if self.prompt_ids is None:
            return "D sent no prompt token ids"
        if not self._complete:
            return "D sent a token without its id"
        return "a tool call has begun" if self._tool_call else None

    def next_segment(self) -> None:
        """A continuation's stream follows from here."""
        self.segment += 1
        self._base = len(self.generated)

    def plain_event(self, data: bytes) -> bytes | None:
        """The client's version of one D chunk's JSON ``data`` without parsing it, where that
        is exact: a first-stream chunk that names its one choice's new token ids and carries
        nothing else the join must judge (no prompt ids, tool call, empty delta or missing
        ids). Returns the data to send (the ids cut out unless the client asked for them), or
        None: :meth:`event` must take the parsed chunk. The bytes rule: vLLM's compact JSON
        cannot hold ``"token_ids":[`` inside a string (the quote would be escaped)."""
        if self.segment or _JUDGED.search(data):
            return None
        start = data.find(_IDS)
        if start < 0 or data.find(_IDS, start + 1) >= 0 or data[start - 1 : start] != b",":
            return None
        end = data.find(b"]", start)
        inner = data[start + len(_IDS) : end]
        if not inner:
            return None  # no new token: the parsed path judges whether to send it
        try:
            if b"," in inner:
                self.generated += list(map(int, inner.split(b",")))
            else:  # one token a step: no list built
                self.generated.append(int(inner))
        except ValueError:
            return None
        kept = data if self._client_ids else data[: start - 1] + data[end + 1 :]
        return kept.replace(_NO_PROMPT_IDS, b"")

    def event(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The client's version of one D chunk (a new object), or None to send nothing."""
        out = dict(chunk)
        self._prompt(out)
        if self.segment == 0:
            self._id, self._created = out.get("id"), out.get("created")
        else:
            out["id"], out["created"] = self._id, self._created
        choices = [c for c in map(self._choice, out.get("choices") or []) if c is not None]
        if "choices" in out:
            out["choices"] = choices
        if out.get("usage") is not None:
            out["usage"] = self.usage = self._usage(out["usage"])
        elif chunk.get("choices") and not choices:
            return None  # only what the router asked for, or a second role delta
        return out

    def _choice(self, choice: Any) -> Any:
        """One choice as the client gets it; None for one that carries only what the router
        asked for (token ids) or a continuation's repeated role."""
        if not isinstance(choice, dict):
            return choice  # not ours to judge: passed on as D sent it
        out = dict(choice)
        self._prompt(out)
        ids = out.get("token_ids")
        if isinstance(ids, list) and all(type(v) is int for v in ids):
            self.generated += ids  # may be empty: text can come a chunk after its ids
        elif _generated(out):
            self._complete = False
        if not self._client_ids:
            out.pop("token_ids", None)
        delta = out.get("delta")
        if isinstance(delta, dict):
            if delta.get("tool_calls"):
                self._tool_call = True
            if self.segment and "role" in delta:
                out["delta"] = {k: v for k, v in delta.items() if k != "role"}
        return out if _produced(out) or "token_ids" in out else None

    def _prompt(self, part: dict[str, Any]) -> None:
        """Take the prompt's ids from ``part`` (a chat chunk carries them, a completion's choice
        does): kept for the first D's stream when the client asked for ids, else dropped."""
        prompt = part.pop("prompt_token_ids", None)
        if self.segment == 0 and isinstance(prompt, list) and _ids(prompt):
            self.prompt_ids = list(prompt)
            if self._client_ids:
                part["prompt_token_ids"] = prompt

    def _usage(self, usage: Any) -> Any:
        """A continuation's usage counts the prompt once and every generated token once (and
        says nothing of cached prompt tokens: P's cache served the continuation, not the
        client's prompt)."""
        if not self.segment or not isinstance(usage, dict) or self.prompt_ids is None:
            return usage
        out = dict(usage)
        out.pop("prompt_tokens_details", None)  # the continuation's cache hits, not the client's
        completion = out.get("completion_tokens")
        if isinstance(completion, int):
            out["completion_tokens"] = completion + self._base
            out["prompt_tokens"] = len(self.prompt_ids)
            out["total_tokens"] = len(self.prompt_ids) + completion + self._base
        return out

    def continuation(self, request: ClientRequest) -> ClientRequest:
        """The request that continues the stream after what was generated so far (only when
        :meth:`resumable`); its ``max_tokens`` and ``min_tokens`` count what was sent."""
        assert self.prompt_ids is not None
        sent = len(self.generated)
        body = dict(request.body)
        for key in _LIMITS:
            if isinstance(body.get(key), int):
                body[key] = max(body[key] - sent, 1)
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(body["min_tokens"] - sent, 0)
        body[RETURN_TOKEN_IDS] = True
        ids = [*self.prompt_ids, *self.generated]
        if request.chat:
            return replace(request, body=body, prompt_ids=tuple(ids))
        body["prompt"] = ids
        return replace(request, body=body)

    def remaining(self, request: ClientRequest) -> int | None:
        """Tokens the client may still get (None: no limit was asked)."""
        limits = [v for k in _LIMITS if isinstance(v := request.body.get(k), int)]
        return min(limits) - len(self.generated) if limits else None
