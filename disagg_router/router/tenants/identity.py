"""Who is calling: an API key to its tenant, and what that tenant may call.

Who calls it: the app's admission checks, once per request, through a :class:`Directory` the
runtime's tenancy (:mod:`disagg_router.router.tenants`) keeps (one per config, rebuilt when a reload
changes ``tenancy`` or ``api_keys``). Keys are compared as SHA-256 digests (the config holds only
digests; a lookup in a table of digests reveals nothing about the keys through its timing);
``api_keys`` (in the clear) are the ``default`` tenant's, compared in constant time. Never logs a
key."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from disagg_router.router.config import (
    DEFAULT_TENANT,
    TenancyConfig,
    TenantLimits,
)
from disagg_router.router.errors import AuthenticationError, ModelNotFound
from disagg_router.router.instances.fairness import PRIORITY_CLASSES, Claim


def hash_key(key: str) -> str:
    """The digest a tenant's ``key_sha256`` lists for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """One tenant as a request meets it: its name, limits and queue claim."""

    name: str
    limits: TenantLimits
    claim: Claim

    @property
    def limited(self) -> bool:
        """True when any per-minute or concurrency limit applies."""
        lim = self.limits
        return any(
            v is not None
            for v in (lim.requests_per_minute, lim.tokens_per_minute, lim.max_concurrent)
        )

    def check_model(self, model: str, served: Iterable[str]) -> None:
        """404 (as for a model nobody serves) when the tenant may not call ``model``: the
        answer lists only the tenant's own models."""
        allowed = self.limits.models
        if allowed is not None and model not in allowed:
            raise ModelNotFound(model, [m for m in served if m in allowed])


def _tenant(name: str, limits: TenantLimits, tenancy: TenancyConfig) -> Tenant:
    claim = Claim(
        tenant=name,
        priority=PRIORITY_CLASSES.index(limits.priority),
        weight=limits.weight,
        max_priority_wait=tenancy.max_priority_wait,
    )
    return Tenant(name, limits, claim)


class Directory:
    """The tenants of one config, by key digest."""

    def __init__(self, tenancy: TenancyConfig, api_keys: list[str]) -> None:
        self.config = tenancy
        self.api_keys = api_keys
        self.default = _tenant(DEFAULT_TENANT, tenancy.default, tenancy)
        self._by_digest = {
            digest: _tenant(t.name, t, tenancy) for t in tenancy.tenants for digest in t.key_sha256
        }
        self._keyed = bool(api_keys or tenancy.tenants)  # then clients do not rank themselves
        self._open = not self._keyed or tenancy.unknown_key == "default"

    def engine_body(self, body: dict[str, Any], tenant: Tenant, assign: bool = True) -> Any:
        """``body`` as it goes to vLLM: with ``tenancy.engine_priority`` (and ``assign``: the
        generation endpoints) its ``priority`` is ``tenant``'s class (0 high, 1 normal, 2 low;
        lower goes first in vLLM); otherwise, when any tenant or key is configured, a client's
        own ``priority`` is dropped (a client must not rank itself above other tenants); else
        ``body`` itself. Never mutates ``body``."""
        if self.config.engine_priority and assign:
            return {**body, "priority": tenant.claim.priority}
        if self._keyed and "priority" in body:
            return {k: v for k, v in body.items() if k != "priority"}
        return body

    def tenants(self) -> list[Tenant]:
        """Every tenant, ``default`` first."""
        return [self.default, *{t.name: t for t in self._by_digest.values()}.values()]

    def identify(self, authorization: str) -> Tenant:
        """The tenant of an ``Authorization`` header's bearer key; a missing or unknown key is
        the default tenant's, or 401 when keys are required."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token:
            found = self._by_digest.get(hash_key(token))
            if found is not None:
                return found
            if any(hmac.compare_digest(token, k) for k in self.api_keys):
                return self.default
        if self._open:
            return self.default
        raise AuthenticationError("Incorrect or missing API key (Authorization: Bearer <key>)")
