"""Keys to tenants: digests, the default tenant, 401s, and the models a tenant may call."""

from __future__ import annotations

import pytest

from disagg_router.router.config import TenancyConfig, TenantConfig
from disagg_router.router.errors import AuthenticationError, ModelNotFound
from disagg_router.router.tenants import Directory, hash_key


def tenancy(**extra: object) -> TenancyConfig:
    acme = TenantConfig(
        name="acme", key_sha256=[hash_key("sk-acme")], priority="high", weight=2, models=["m1"]
    )
    return TenancyConfig.model_validate({"tenants": [acme.model_dump()], **extra})


def test_a_key_names_its_tenant_and_its_claim() -> None:
    found = Directory(tenancy(), []).identify("Bearer sk-acme")
    assert found.name == "acme"
    assert (found.claim.tenant, found.claim.priority, found.claim.weight) == ("acme", 0, 2.0)


def test_an_unknown_or_missing_key_is_refused_when_keys_are_required() -> None:
    directory = Directory(tenancy(), [])
    for header in ("Bearer sk-other", "", "Basic sk-acme", "Bearer "):
        with pytest.raises(AuthenticationError):
            directory.identify(header)


def test_an_unknown_key_is_the_default_tenants_when_configured_so() -> None:
    directory = Directory(tenancy(unknown_key="default"), [])
    assert directory.identify("Bearer sk-other").name == "default"
    assert directory.identify("").name == "default"


def test_plain_api_keys_are_the_default_tenants_and_others_are_refused() -> None:
    directory = Directory(TenancyConfig(), ["sk-plain"])
    assert directory.identify("Bearer sk-plain").name == "default"
    with pytest.raises(AuthenticationError):
        directory.identify("Bearer sk-acme")


def test_without_any_key_configured_everyone_is_the_default_tenant() -> None:
    assert Directory(TenancyConfig(), []).identify("").name == "default"


def test_a_model_outside_the_tenants_list_is_a_404_naming_only_its_own_models() -> None:
    acme = Directory(tenancy(), []).identify("Bearer sk-acme")
    acme.check_model("m1", ["m1", "m2"])
    with pytest.raises(ModelNotFound) as caught:
        acme.check_model("m2", ["m1", "m2"])
    assert caught.value.status == 404 and caught.value.param == "model"
    assert "m1" in caught.value.message and "m2, " not in caught.value.message


def test_the_digest_is_sha256_hex() -> None:
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_engine_body_ranks_by_the_tenant_never_by_the_client() -> None:
    ranked = Directory(tenancy(engine_priority=True), [])
    acme = ranked.identify("Bearer sk-acme")  # priority high: 0
    body = {"prompt": "x", "priority": -9}
    assert ranked.engine_body(body, acme)["priority"] == 0
    routes = ranked.engine_body(body, acme, assign=False)
    assert "priority" not in routes  # the other routes: dropped, never assigned
    assert "priority" not in Directory(tenancy(), []).engine_body(body, acme)
    assert Directory(TenancyConfig(), []).engine_body(body, acme) is body  # no keys: as it is
    assert body == {"prompt": "x", "priority": -9}  # never mutated
