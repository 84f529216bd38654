"""Pure request/response rewriting for the two legs of a P/D dispatch.

Who calls it: the dispatch's legs (:mod:`disagg_router.router.dispatch.legs`: leg bodies, P's
answer) and relay (:mod:`disagg_router.router.dispatch.relay`: usage, the client's answer) and the
identity probe (:mod:`disagg_router.router.health.monitor`). Every function returns a new object and
never mutates its input. No I/O here, so all of it is unit-tested directly.

Wire facts (vLLM 0.32 NIXL connectors): the prefill leg carries ``kv_transfer_params`` with
``do_remote_decode: true``; the decode leg carries ``do_remote_prefill: true`` plus P's
``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size``, ``pp_size`` and
``remote_request_id``. In pull mode D gets exactly the ``kv_transfer_params`` P returned.
"""

from __future__ import annotations

import copy
from typing import Any

from disagg_router.connector.contract import (
    KV_TRANSFER_PARAMS,
    REMOTE_PREFILL_CACHED_TOKENS,
    TRANSFER_ID,
    decode_leg_params,
    prefill_leg_params,
    read_prefill_answer,
)
from disagg_router.router.config import PushIdentity

PROMPT_TOKEN_IDS = "prompt_token_ids"

# Fields that make no sense, or are rejected by vLLM, on a 1-token non-streamed prefill (token ids
# would only make P's answer longer: the router reads its usage and kv_transfer_params).
_PREFILL_DROP = ("stream_options", "min_tokens", "return_token_ids", KV_TRANSFER_PARAMS)


def strip_client_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request without ``kv_transfer_params`` (only the router may set them).

    A shallow copy: nested values are shared, and nothing here mutates them.
    """
    return {k: v for k, v in body.items() if k != KV_TRANSFER_PARAMS}


def prefill_body(
    body: dict[str, Any], chat: bool, transfer_id: str, *, probe: bool = False
) -> dict[str, Any]:
    """The P leg: same request, 1 token, not streamed, asked to keep KV for a remote decode.

    ``probe``: an identity probe (``disagg_router.connector.contract.IDENTITY_PROBE_KEY``): our
    connector answers its identity without pinning blocks; vLLM's connectors ignore the key and keep
    the blocks for their lease."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out["max_tokens"] = 1
    if chat and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out[KV_TRANSFER_PARAMS] = prefill_leg_params(transfer_id, probe=probe)
    return out


def decode_body_push(
    body: dict[str, Any], identity: PushIdentity, request_id: str, transfer_id: str
) -> dict[str, Any]:
    """The D leg in push mode: the full request plus P's identity, sent before P finishes."""
    out = strip_client_fields(body)
    out[KV_TRANSFER_PARAMS] = decode_leg_params(
        engine_id=identity.engine_id,
        host=identity.host,
        port=identity.port,
        tp_size=identity.tp_size,
        pp_size=identity.pp_size,
        request_id=request_id,
        transfer_id=transfer_id,
    )
    return out


def decode_body_pull(
    body: dict[str, Any], prefill_kv: dict[str, Any], transfer_id: str
) -> dict[str, Any]:
    """The D leg in pull mode: the full request plus the ``kv_transfer_params`` P returned."""
    out = strip_client_fields(body)
    kv = copy.deepcopy(prefill_kv)
    kv[TRANSFER_ID] = transfer_id
    out[KV_TRANSFER_PARAMS] = kv
    return out


def with_prompt_ids(body: dict[str, Any], prompt_ids: tuple[int, ...] | None) -> dict[str, Any]:
    """A chat leg's body with its prompt given as token ids (vLLM's
    ``kv_transfer_params.prompt_token_ids``: the chat template is not rendered again); ``body``
    itself when there are none."""
    if prompt_ids is None:
        return body
    kv = body.get(KV_TRANSFER_PARAMS)
    params = dict(kv) if isinstance(kv, dict) else {}
    params[PROMPT_TOKEN_IDS] = list(prompt_ids)
    return {**body, KV_TRANSFER_PARAMS: params}


def identity_from_kv(kv: dict[str, Any], known: PushIdentity | None = None) -> PushIdentity:
    """P's identity from the ``kv_transfer_params`` it returned (read with the connector's
    contract); ``ValueError`` if incomplete. ``known``: an identity P's answer usually repeats
    (the one the D leg was sent with); returned as it is when every field matches, so the usual
    answer is not validated into a new model per request."""
    try:
        peer = read_prefill_answer(kv).peer
        if known is not None and (
            known.engine_id,
            known.host,
            known.port,
            known.tp_size,
            known.pp_size,
        ) == (peer.engine_id, peer.host, peer.port, peer.tp_size, peer.pp_size):
            return known
        return PushIdentity(
            engine_id=peer.engine_id,
            host=peer.host,
            port=peer.port,
            tp_size=peer.tp_size,
            pp_size=peer.pp_size,
        )
    except ValueError as exc:  # the contract's ContractError, or the identity's own bounds
        raise ValueError(f"incomplete kv_transfer_params from prefill: {exc}") from exc


def prefill_usage(answer: dict[str, Any]) -> Any:
    """P's usage; without ``prompt_tokens_details`` (vLLM reports them only when started with
    ``--enable-prompt-tokens-details``) its cached count is taken from the
    ``remote_prefill_cached_tokens`` of P's ``kv_transfer_params`` where present."""
    usage = answer.get("usage")
    kv = answer.get(KV_TRANSFER_PARAMS)
    if not isinstance(usage, dict) or not isinstance(kv, dict):
        return usage
    cached = kv.get(REMOTE_PREFILL_CACHED_TOKENS)
    if isinstance(usage.get("prompt_tokens_details"), dict) or not isinstance(cached, int):
        return usage
    return {**usage, "prompt_tokens_details": {"cached_tokens": cached}}


def merge_usage(decode_usage: Any, prefill_usage: Any) -> Any:
    """Usage for the client: prompt and cached tokens from P, completion tokens from D.

    D counts the transferred prompt blocks as prefix-cache hits, so its cached count is not what
    the client paid for. Returns ``decode_usage`` unchanged when either side is not a mapping.
    """
    if not isinstance(decode_usage, dict) or not isinstance(prefill_usage, dict):
        return decode_usage
    out = dict(decode_usage)
    prompt = prefill_usage.get("prompt_tokens")
    if isinstance(prompt, int):
        out["prompt_tokens"] = prompt
        completion = out.get("completion_tokens")
        if isinstance(completion, int):
            out["total_tokens"] = prompt + completion
    p_details = prefill_usage.get("prompt_tokens_details")
    cached = p_details.get("cached_tokens") if isinstance(p_details, dict) else None
    if "prompt_tokens_details" in out or cached is not None:
        details = out.get("prompt_tokens_details")
        details = dict(details) if isinstance(details, dict) else {}
        details["cached_tokens"] = cached if isinstance(cached, int) else 0
        out["prompt_tokens_details"] = details
    return out


def client_response(decode_json: dict[str, Any], prefill_usage: Any) -> dict[str, Any]:
    """D's non-streamed answer as the client sees it: merged usage, no ``kv_transfer_params``."""
    out = {k: v for k, v in decode_json.items() if k != KV_TRANSFER_PARAMS}
    if "usage" in out:
        out["usage"] = merge_usage(out["usage"], prefill_usage)
    return out
