"""The one place a policy's name meets its class.

Who calls it: :class:`disagg_router.router.routing.pools.Pool`, when it is created and when its
policy settings change (:func:`make_policy`); the config's test checks :data:`POLICIES` against
``disagg_router.router.config.PolicyName``.
"""

from __future__ import annotations

from disagg_router.router.config import LoadSignalsConfig, PoolConfig
from disagg_router.router.routing.policies.base import Policy
from disagg_router.router.routing.policies.kv_aware import KvAware
from disagg_router.router.routing.policies.least_in_flight import LeastInFlight
from disagg_router.router.routing.policies.power_of_two import PowerOfTwo
from disagg_router.router.routing.policies.prefix_affinity import PrefixAffinity
from disagg_router.router.routing.policies.round_robin import RoundRobin
from disagg_router.router.routing.policies.session_affinity import SessionAffinity

POLICIES: dict[str, type[Policy]] = {
    policy.name: policy
    for policy in (
        RoundRobin,
        LeastInFlight,
        PowerOfTwo,
        PrefixAffinity,
        SessionAffinity,
        KvAware,
    )
}


def policy_type(config: PoolConfig) -> type[Policy]:
    """The class of the pool's policy (the config is validated: the name is known)."""
    return POLICIES[config.policy]


def make_policy(config: PoolConfig, signals: LoadSignalsConfig | None = None) -> Policy:
    """A fresh policy for a pool's config (``signals``: the scrape settings some policies read)."""
    return policy_type(config).from_config(config, signals or LoadSignalsConfig())
