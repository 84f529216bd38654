"""One client request as the router carries it: its ids and trace (:class:`RequestContext`) and,
once validated, its body (:class:`ClientRequest`).

Who calls it: the app's request guard (:mod:`disagg_router.router.http.guard`) builds one
:class:`RequestContext` per HTTP request; validation (:mod:`disagg_router.router.http.validation`)
builds the :class:`ClientRequest`; the dispatch and the request log read both. Defined here, below
the app and the dispatch, so that neither imports the other's types.

In a :class:`RequestContext`, ``request_id`` is the router's own unique id (the first dispatch
attempt uses it for both legs; a retry gets a fresh one); ``client_id`` is the client's
``X-Request-Id`` when it is safe to log (never sent to vLLM). ``trace`` is the tracing span of the
request (a no-op one when tracing is off).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg_router.router.ids import new_request_id
from disagg_router.router.instances.fairness import NO_CLAIM, Claim
from disagg_router.router.observability.tracing import NO_SPAN, Span

_SAFE_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def safe_client_id(value: str | None) -> str | None:
    """``value`` if it is a short id of safe characters (fit for logs), else None."""
    if value is not None and _SAFE_CLIENT_ID.fullmatch(value):
        return value
    return None


@dataclass(frozen=True)
class RequestContext:
    """Ids (and the trace span) of one client request."""

    request_id: str = field(default_factory=new_request_id)
    client_id: str | None = None
    trace: Span = NO_SPAN
    claim: Claim = NO_CLAIM
    """The tenant's place in the instances' admission queues (set once the tenant is known)."""


@dataclass(frozen=True)
class ClientRequest:
    """A validated generation request. ``body`` is the parsed JSON (not to be mutated)."""

    body: dict[str, Any]
    chat: bool
    stream: bool
    model: str
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-cased names (routing)
    prompt_ids: tuple[int, ...] | None = None
    """A chat continuing a stream: the prompt as token ids (template rendered, generated ids
    after it), sent to P and D in ``kv_transfer_params`` (:mod:`..dispatch.joining`)."""

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"
