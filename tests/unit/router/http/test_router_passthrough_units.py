"""The pieces of the pass-through routes that need no router server: the ``passthrough_pool`` key,
the body check, reading ``max_model_len`` from an instance's ``/v1/models``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from disagg_router.router.config import InstanceConfig, LimitsConfig, settings_from_mapping
from disagg_router.router.errors import ClientRequestError, ConfigError, ModelNotFound
from disagg_router.router.health.model_info import learn_max_model_len, model_len_of
from disagg_router.router.http.validation import parse_passthrough
from disagg_router.router.instances.state import BackendState
from disagg_router.router.runtime import http_client
from tests.support.scripted import scripted

POOLS = {"instances": [{"url": "http://127.0.0.1:8100"}]}


def test_passthrough_pool_defaults_to_decode_and_a_model_may_name_its_own() -> None:
    short = settings_from_mapping({"models": ["a"], "prefill": POOLS, "decode": POOLS})
    assert short.routes()["a"].passthrough_pool == "decode"
    both = {"prefill": POOLS, "decode": POOLS}
    mapped = settings_from_mapping(
        {
            "models": {"a": both, "b": {**both, "passthrough_pool": "decode"}},
            "passthrough_pool": "prefill",
        }
    )
    assert mapped.routes()["a"].passthrough_pool == "prefill"
    assert mapped.routes()["b"].passthrough_pool == "decode"


def test_a_bad_passthrough_pool_names_the_field() -> None:
    with pytest.raises(ConfigError) as err:
        settings_from_mapping(
            {"models": ["a"], "prefill": POOLS, "decode": POOLS, "passthrough_pool": "p"}
        )
    assert err.value.field == "passthrough_pool"


def test_body_check_defaults_the_model_only_when_one_is_served() -> None:
    limits = LimitsConfig()
    assert parse_passthrough(b'{"prompt": "x"}', ["a"], limits) == ("a", {"prompt": "x"}, False)
    with pytest.raises(ClientRequestError) as err:
        parse_passthrough(b'{"prompt": "x"}', ["a", "b"], limits)
    assert err.value.param == "model"
    with pytest.raises(ModelNotFound):
        parse_passthrough(b'{"model": "c"}', ["a", "b"], limits)
    deep = b'{"model": "a", "x": ' + b"[" * 40 + b"]" * 40 + b"}"
    with pytest.raises(ClientRequestError, match="nests deeper"):
        parse_passthrough(deep, ["a"], limits)
    with pytest.raises(ClientRequestError, match="not a valid JSON number"):
        parse_passthrough(b'{"model": "a", "x": NaN}', ["a"], limits)


@pytest.mark.parametrize(
    ("answer", "found"),
    [
        ({"data": [{"id": "other", "max_model_len": 10}, {"id": "m", "max_model_len": 20}]}, 20),
        ({"data": [{"id": "other", "max_model_len": 10}]}, 10),
        ({"data": [{"id": "m"}]}, None),
        ({"data": [{"id": "m", "max_model_len": True}]}, None),
        ({"data": "x"}, None),
        ([], None),
    ],
)
def test_model_len_of_reads_the_served_models_card(answer: Any, found: int | None) -> None:
    assert model_len_of(answer, "m") == found


def _learn(handler: Any, known: int | None) -> int | None:
    """What a backend knows of its ``max_model_len`` after asking a server scripted by
    ``handler`` (which sees the ``/v1/models`` request)."""
    with scripted(handler) as (server,):
        backend = BackendState(InstanceConfig(url=server.url), "decode", model="m")
        backend.max_model_len = known
        settings = settings_from_mapping({"models": ["m"], "prefill": POOLS, "decode": POOLS})

        async def run() -> None:
            async with http_client(settings) as client:
                await learn_max_model_len(client, backend, 5.0)

        asyncio.run(run())
    return backend.max_model_len


def test_learning_keeps_the_known_value_when_the_instance_gives_none() -> None:
    card = {"data": [{"id": "m", "max_model_len": 2048}]}
    asked: list[str] = []

    def models(request: httpx.Request) -> httpx.Response:
        asked.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json=card)

    assert _learn(models, None) == 2048
    assert asked == ["GET /v1/models"]
    assert _learn(lambda r: httpx.Response(500, text="boom"), 1024) == 1024
    assert _learn(lambda r: httpx.Response(200, text="not json"), 1024) == 1024
    assert _learn(lambda r: httpx.Response(200, json={"data": []}), 1024) == 1024
