"""One pool (the P or the D instances of one model) and the policy that picks among them."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from disagg_router.router.config._base import Frozen
from disagg_router.router.config.discovery import DiscoveryConfig, StaticDiscovery
from disagg_router.router.config.instances import InstanceConfig

PolicyName = Literal[
    "round_robin",
    "least_in_flight",
    "power_of_two",
    "prefix_affinity",
    "session_affinity",
    "kv_aware",
]


class ShapeConfig(Frozen):
    """The engine shape a pool's instances are expected to have; only ``check-config`` reads it
    (at run time the identity probes learn each instance's own)."""

    tp_size: int = Field(default=1, ge=1, description="tensor parallel size")
    pp_size: int = Field(default=1, ge=1, description="pipeline parallel size")
    block_size: int = Field(default=16, ge=1, description="KV block size in tokens")
    num_kv_heads: int | None = Field(
        default=None, ge=1, description="the model's KV heads (null: not declared)"
    )


class PoolConfig(Frozen):
    """One pool (the P or the D instances of one model): its instances, listed (``instances``)
    or discovered, and how a dispatch picks among them.

    ``prefix_chars``: how much of the rendered prompt ``prefix_affinity`` hashes (token-id prompts:
    a quarter as many ids). ``load_factor``: the affinity policies' load bound, an instance takes
    at most ``ceil(load_factor * (in-flight legs of the pool + 1) / instances)`` legs before its
    keys spill to their next choice. ``session_header``: where ``session_affinity`` reads the
    session key (the request's ``user`` field when the header is absent).
    """

    discovery: DiscoveryConfig = Field(default_factory=StaticDiscovery)
    instances: list[InstanceConfig] = Field(default_factory=list)
    policy: PolicyName = "round_robin"
    prefix_chars: int = Field(default=2048, ge=16)
    load_factor: float = Field(default=1.25, ge=1.0)
    session_header: str = Field(default="x-session-id", min_length=1)
    shape: ShapeConfig | None = Field(
        default=None,
        description="expected engine shape of the pool's instances; check-config reports a P/D "
        "combination the KV connector cannot serve (null: learned at run time only)",
    )

    @field_validator("instances")
    @classmethod
    def _listed_iff_static(
        cls, value: list[InstanceConfig], info: ValidationInfo
    ) -> list[InstanceConfig]:
        discovery = info.data.get("discovery", StaticDiscovery())
        if discovery.source == "static" and not value:
            raise ValueError("a static pool lists at least one instance")
        if discovery.source != "static" and value:
            raise ValueError("a discovered pool lists no instances (discovery finds them)")
        return value

    @model_validator(mode="after")
    def _unique(self) -> PoolConfig:
        labels = [i.label for i in self.instances]
        if len(set(labels)) != len(labels):
            raise ValueError("instances must have distinct urls/names")
        return self
