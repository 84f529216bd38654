"""Router configuration: pydantic models loaded from YAML, one module per section.

Who calls it: ``disagg-router serve``/``check-config`` (:mod:`disagg_router.router.cli`) and hot
reload (:mod:`disagg_router.router.reload`) via :func:`load_config`, and tests (which build
:class:`RouterSettings` directly). Models are frozen; every field is validated, unknown keys are
rejected, and :class:`ConfigError` names the offending field path (``prefill.instances.0.url``). No
timeout may be infinite: each is a positive number of seconds.

Sections: :mod:`.instances`, :mod:`.discovery`, :mod:`.pools` (a pool and its policy),
:mod:`.models` (a model's own sections and its route), :mod:`.timeouts`, :mod:`.health` (with
``load_signals``), :mod:`.limits` (``admission``, ``breaker``, ``limits``, ``drain``),
:mod:`.migration`, :mod:`.push`, :mod:`.tenants` (``tenancy``), :mod:`.telemetry` (``logging``,
``tracing``), :mod:`.settings` (the whole file, ``reload``, and reading it); renamed keys in
:mod:`._base`. Every name is imported from here."""

from disagg_router.router.config._base import RENAMED_KEYS, deprecated_keys
from disagg_router.router.config.discovery import (
    DiscoveryConfig,
    DnsDiscovery,
    KubernetesDiscovery,
    StaticDiscovery,
)
from disagg_router.router.config.health import HealthConfig, LoadSignalsConfig
from disagg_router.router.config.instances import InstanceConfig, PushIdentity
from disagg_router.router.config.limits import (
    AdmissionConfig,
    BreakerConfig,
    DrainConfig,
    LimitsConfig,
)
from disagg_router.router.config.migration import MigrationConfig
from disagg_router.router.config.models import (
    DisaggregationConfig,
    KvEventsConfig,
    Mode,
    ModelConfig,
    ModelRoute,
    PassthroughPool,
)
from disagg_router.router.config.pools import PolicyName, PoolConfig, ShapeConfig
from disagg_router.router.config.push import Bind, PushConfig
from disagg_router.router.config.settings import (
    ReloadConfig,
    RouterSettings,
    load_config,
    settings_from_mapping,
)
from disagg_router.router.config.telemetry import LoggingConfig, TracingConfig
from disagg_router.router.config.tenants import (
    DEFAULT_TENANT,
    Priority,
    StoreConfig,
    TenancyConfig,
    TenantConfig,
    TenantLimits,
)
from disagg_router.router.config.timeouts import TimeoutsConfig

__all__ = [
    "DEFAULT_TENANT",
    "RENAMED_KEYS",
    "AdmissionConfig",
    "Bind",
    "BreakerConfig",
    "DisaggregationConfig",
    "DiscoveryConfig",
    "DnsDiscovery",
    "DrainConfig",
    "HealthConfig",
    "InstanceConfig",
    "KubernetesDiscovery",
    "KvEventsConfig",
    "LimitsConfig",
    "LoadSignalsConfig",
    "LoggingConfig",
    "MigrationConfig",
    "Mode",
    "ModelConfig",
    "ModelRoute",
    "PassthroughPool",
    "PolicyName",
    "PoolConfig",
    "Priority",
    "PushConfig",
    "PushIdentity",
    "ReloadConfig",
    "RouterSettings",
    "ShapeConfig",
    "StaticDiscovery",
    "StoreConfig",
    "TenancyConfig",
    "TenantConfig",
    "TenantLimits",
    "TimeoutsConfig",
    "TracingConfig",
    "deprecated_keys",
    "load_config",
    "settings_from_mapping",
]
