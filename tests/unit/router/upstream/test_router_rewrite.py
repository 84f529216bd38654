"""Request ids, leg bodies, usage merge and client-request validation (pure functions)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from disagg_router.connector.contract import has_engine_suffix
from disagg_router.router.config import PushIdentity, settings_from_mapping
from disagg_router.router.errors import (
    ClientRequestError,
    UpstreamHTTPError,
    error_payload,
    outcome_label,
)
from disagg_router.router.http.validation import parse_client_request
from disagg_router.router.ids import new_request_id
from disagg_router.router.routing.table import LiveRouting
from disagg_router.router.upstream.rewrite import (
    client_response,
    decode_body_pull,
    decode_body_push,
    identity_from_kv,
    merge_usage,
    prefill_body,
    prefill_usage,
    strip_client_fields,
)


def test_request_ids_are_fresh_hex_without_vllm_suffix() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    for rid in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
        assert not has_engine_suffix(rid)
    assert has_engine_suffix("abc-0123abcd")


def test_prefill_body_caps_tokens_and_does_not_mutate() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"x": 1},
    }
    snapshot = json.dumps(body, sort_keys=True)
    out = prefill_body(body, chat=True, transfer_id="t1")
    assert out == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 1,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": "t1",
        },
    }
    assert json.dumps(body, sort_keys=True) == snapshot
    completion = prefill_body({"model": "m", "prompt": "p", "max_tokens": 9}, False, "t")
    assert completion["max_tokens"] == 1
    assert "max_completion_tokens" not in completion


def test_decode_bodies() -> None:
    body = {"model": "m", "prompt": "p", "stream": True, "kv_transfer_params": {"evil": True}}
    ident = PushIdentity(engine_id="e1", host="10.0.0.1", port=5601, tp_size=2, pp_size=1)
    push = decode_body_push(body, ident, "rid", "tid")
    assert push["stream"] is True
    assert push["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e1",
        "remote_host": "10.0.0.1",
        "remote_port": 5601,
        "tp_size": 2,
        "pp_size": 1,
        "remote_request_id": "rid",
        "transfer_id": "tid",
    }
    p_kv = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1, 2]]}
    pull = decode_body_pull(body, p_kv, "tid")
    assert pull["kv_transfer_params"] == {**p_kv, "transfer_id": "tid"}
    assert "transfer_id" not in p_kv
    assert strip_client_fields(body) == {"model": "m", "prompt": "p", "stream": True}


def test_identity_from_kv() -> None:
    kv = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 5, "tp_size": 4}
    assert identity_from_kv(kv) == PushIdentity(engine_id="e", host="h", port=5, tp_size=4)
    with pytest.raises(ValueError, match="incomplete"):
        identity_from_kv({"remote_engine_id": "e"})


def test_identity_from_kv_repeats_the_known_identity_only_when_every_field_matches() -> None:
    known = PushIdentity(engine_id="e", host="h", port=5, tp_size=4)
    kv = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 5, "tp_size": 4}
    assert identity_from_kv(kv, known) is known
    moved = identity_from_kv({**kv, "remote_port": 6}, known)
    assert moved == PushIdentity(engine_id="e", host="h", port=6, tp_size=4)
    with pytest.raises(ValueError, match="incomplete"):
        identity_from_kv({**kv, "remote_port": 70000}, known)  # the identity's own bounds
    with pytest.raises(ValueError, match="incomplete"):
        identity_from_kv({"remote_engine_id": "e"}, known)


def test_usage_takes_prompt_and_cached_from_prefill() -> None:
    d_usage = {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 10},
    }
    p_usage = {
        "prompt_tokens": 10,
        "completion_tokens": 1,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert merge_usage(d_usage, p_usage) == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert merge_usage(d_usage, None) == d_usage
    no_details = merge_usage({"prompt_tokens": 3, "completion_tokens": 2}, {"prompt_tokens": 3})
    assert no_details == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    resp = client_response({"id": "x", "usage": d_usage, "kv_transfer_params": None}, p_usage)
    assert "kv_transfer_params" not in resp
    assert resp["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_validation_accepts_vllm_prompt_shapes() -> None:
    for prompt in ("text", [1, 2, 3], ["one"], [[1, 2]]):
        raw = json.dumps({"model": "m", "prompt": prompt}).encode()
        req = parse_client_request(raw, chat=False, models={"m"})
        assert req.path == "/v1/completions"
        assert req.stream is False
    chat = parse_client_request(
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true}',
        chat=True,
        models={"m"},
    )
    assert chat.stream and chat.path == "/v1/chat/completions"


def test_validation_error_carries_param_and_status() -> None:
    with pytest.raises(ClientRequestError) as info:
        parse_client_request(b'{"model": "x", "prompt": "p"}', chat=False, models={"m"})
    assert info.value.status == 404
    payload = error_payload(info.value)
    assert payload["error"]["param"] == "model"
    assert payload["error"]["code"] == "model_not_found"


def test_an_unknown_model_is_one_404_at_validation_and_at_dispatch() -> None:
    """Validation (before anything else) and the routing table (a reload may have dropped the
    model since) raise the same error: same payload, status and outcome label."""
    settings = settings_from_mapping(
        {
            "models": ["m"],
            "prefill": {"instances": [{"url": "http://127.0.0.1:1"}]},
            "decode": {"instances": [{"url": "http://127.0.0.1:2"}]},
        }
    )
    with pytest.raises(ClientRequestError) as parsed:
        parse_client_request(b'{"model": "x", "prompt": "p"}', chat=False, models={"m"})
    with pytest.raises(ClientRequestError) as looked_up:
        LiveRouting(settings).table.lookup("x")
    for err in (parsed.value, looked_up.value):
        assert (err.status, outcome_label(err)) == (404, "invalid_request")
    assert error_payload(parsed.value) == error_payload(looked_up.value)
    assert "served models: m" in looked_up.value.message


def test_upstream_4xx_is_passed_through_and_5xx_becomes_502() -> None:
    client_err = UpstreamHTTPError("decode", "d0", 400, {"error": {"message": "too long"}})
    assert client_err.status == 400 and not client_err.retryable
    assert client_err.message == "too long"
    server_err = UpstreamHTTPError("prefill", "p0", 500, "boom")
    assert server_err.status == 502 and server_err.retryable
    assert "prefill instance p0" in server_err.message


def test_prefill_usage_falls_back_to_kv_cached_tokens() -> None:
    usage = {"prompt_tokens": 200, "completion_tokens": 1, "total_tokens": 201}
    kv = {"remote_engine_id": "e", "remote_prefill_cached_tokens": 128}
    assert prefill_usage({"usage": usage, "kv_transfer_params": kv}) == {
        **usage,
        "prompt_tokens_details": {"cached_tokens": 128},
    }
    with_details = {**usage, "prompt_tokens_details": {"cached_tokens": 0}}
    answer = {"usage": with_details, "kv_transfer_params": kv}
    assert prefill_usage(answer) == with_details
    assert prefill_usage({"usage": usage, "kv_transfer_params": None}) == usage
