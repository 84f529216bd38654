"""Validation of client requests before any upstream traffic.

Who calls it: the app (:mod:`disagg_router.router.http.app`), on the raw body of ``/v1/completions``
and ``/v1/chat/completions``, and the pass-through routes
(:mod:`disagg_router.router.http.passthrough`), whose bodies get the same JSON bounds and a
``model`` check only (:func:`parse_passthrough`). It checks what the router itself relies on (JSON
object, model, prompt/messages, stream, token limits, ``n``) and what must never reach an instance:
a body that is not UTF-8, nested deeper than ``limits.max_json_depth``, non-finite numbers (``NaN``,
``Infinity``, ``1e999``), wrongly typed sampling parameters, integers beyond 64 bits (sampling
fields, token ids), absurd token counts. Everything else is left for vLLM to judge (its 4xx is
passed through). Raises :class:`ClientRequestError` naming the offending field; never returns a
partial result and never raises anything else.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from disagg_router.router.config import LimitsConfig
from disagg_router.router.errors import ClientRequestError, ModelNotFound
from disagg_router.router.request import ClientRequest
from disagg_router.router.upstream import codec

# Sampling parameters whose JSON type the router checks (vLLM would reject others with a 400
# after the request already cost a P leg): name -> (accepted Python types, description).
_NUMBER = (int, float)
_TYPED_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "temperature": (_NUMBER, "a number"),
    "top_p": (_NUMBER, "a number"),
    "min_p": (_NUMBER, "a number"),
    "presence_penalty": (_NUMBER, "a number"),
    "frequency_penalty": (_NUMBER, "a number"),
    "repetition_penalty": (_NUMBER, "a number"),
    "length_penalty": (_NUMBER, "a number"),
    "top_k": ((int,), "an integer"),
    "seed": ((int,), "an integer"),
    "min_tokens": ((int,), "an integer"),
    "top_logprobs": ((int,), "an integer"),
    "echo": ((bool,), "a boolean"),
    "ignore_eos": ((bool,), "a boolean"),
    "logit_bias": ((dict,), "an object"),
    "user": ((str,), "a string"),
}


# Integers vLLM's request models hold as 64-bit (``seed`` is bounded to torch.long there; the
# sampling parameters become tensors): a larger literal would be forwarded and fail inside vLLM.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def _depth(value: Any, limit: int) -> bool:
    """True when ``value`` nests containers no deeper than ``limit`` (iterative, no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            # Only containers nest: a prompt's token ids are not pushed one by one.
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return True


def _load(raw: bytes, max_depth: int) -> Any:
    try:
        body = codec.loads_fast(raw)
    except (ValueError, RecursionError):  # msgspec refused it: json decides, with its messages
        body = _load_slow(raw, max_depth)
    # Each container opens with a bracket, so a body with no more brackets than the limit (one
    # prompt of token ids has one) cannot nest deeper: the walk is only for the rest.
    if raw.count(b"[") + raw.count(b"{") > max_depth and not _depth(body, max_depth):
        raise ClientRequestError(f"request body nests deeper than {max_depth} levels", None)
    return body


def _load_slow(raw: bytes, max_depth: int) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ClientRequestError(f"request body is not UTF-8: {exc.reason}", None) from exc
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise ClientRequestError(
            f"request body nests deeper than {max_depth} levels", None
        ) from exc
    except ValueError as exc:
        raise ClientRequestError(f"request body is not valid JSON: {exc}", None) from exc
    return body


def _check_types(body: dict[str, Any]) -> None:
    for key, (types, what) in _TYPED_FIELDS.items():
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) and bool not in types:
            raise ClientRequestError(f"{key} must be {what}", key)
        if not isinstance(value, types):
            raise ClientRequestError(f"{key} must be {what}", key)
        if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
            raise ClientRequestError(f"{key} must be between {_INT64_MIN} and {_INT64_MAX}", key)
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))
    ):
        raise ClientRequestError("stop must be a string or an array of strings", "stop")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: Any) -> bool:
    # type() of each element in C; {int} excludes bool, as _is_int does.
    return isinstance(value, list) and bool(value) and set(map(type, value)) == {int}


def _check_token_ids(ids: list[int]) -> None:
    """Token ids vLLM can hold (non-negative 64-bit); its vocabulary check judges the rest."""
    if min(ids) < 0 or max(ids) > _INT64_MAX:
        raise ClientRequestError(f"token ids must be integers between 0 and {_INT64_MAX}", "prompt")


def _check_prompt(prompt: Any) -> None:
    """One prompt: a string, token ids, or a one-element batch of either."""
    if isinstance(prompt, str):
        return
    if _is_token_list(prompt):
        _check_token_ids(prompt)
        return
    one = isinstance(prompt, list) and len(prompt) == 1
    if one and isinstance(prompt[0], str):
        return
    if one and _is_token_list(prompt[0]):
        _check_token_ids(prompt[0])
        return
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ClientRequestError(
            "only one prompt per request is supported in disaggregated mode", "prompt"
        )
    raise ClientRequestError(
        "prompt must be a string, a list of token ids, or a one-element list of either", "prompt"
    )


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ClientRequestError("messages must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ClientRequestError(
                "each message must be an object with a string role", f"messages.{i}"
            )


def parse_client_request(
    raw: bytes,
    chat: bool,
    models: Collection[str],
    headers: Mapping[str, str] | None = None,
    limits: LimitsConfig | None = None,
) -> ClientRequest:
    """Parse and check one request body; :class:`ClientRequestError` on the first problem.

    ``headers`` (names lower-cased) are kept for the routing policies; ``limits`` bound the body
    (defaults: :class:`LimitsConfig`)."""
    limits = limits or LimitsConfig()
    body = _load(raw, limits.max_json_depth)
    if not isinstance(body, dict):
        raise ClientRequestError("request body must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ClientRequestError("model is required and must be a string", "model")
    if model not in models:
        raise ModelNotFound(model, models)
    if chat:
        _check_messages(body.get("messages"))
    elif "prompt" not in body:
        raise ClientRequestError("prompt is required", "prompt")
    else:
        _check_prompt(body["prompt"])
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ClientRequestError("stream must be a boolean", "stream")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not _is_int(value) or not 1 <= value <= limits.max_tokens):
            raise ClientRequestError(
                f"{key} must be an integer between 1 and {limits.max_tokens}", key
            )
    _check_types(body)
    n = body.get("n")
    if n is not None and n != 1:
        raise ClientRequestError("only n=1 is supported in disaggregated mode", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise ClientRequestError("only best_of=1 is supported in disaggregated mode", "best_of")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ClientRequestError("stream_options must be an object", "stream_options")
    return ClientRequest(
        body=body, chat=chat, stream=stream, model=model, headers=dict(headers or {})
    )


def parse_passthrough(
    raw: bytes, models: Collection[str], limits: LimitsConfig
) -> tuple[str, dict[str, Any], bool]:
    """``(model, body, stream)`` of a request to a pass-through route: a JSON object within the
    body bounds, whose ``model`` is served. Without a ``model`` vLLM uses its own, so the router
    does too when it serves one model; with several that is a 400 naming ``model``. The rest is
    vLLM's to judge."""
    body = _load(raw, limits.max_json_depth)
    if not isinstance(body, dict):
        raise ClientRequestError("request body must be a JSON object", None)
    model = body.get("model")
    if model is None and len(models) == 1:
        model = next(iter(models))
    if model is None:
        raise ClientRequestError("model is required when the router serves several models", "model")
    if not isinstance(model, str) or not model:
        raise ClientRequestError("model must be a non-empty string (one model's name)", "model")
    if model not in models:
        raise ModelNotFound(model, models)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ClientRequestError("stream must be a boolean", "stream")
    return model, body, bool(stream)
