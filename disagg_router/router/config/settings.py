"""The whole file (:class:`RouterSettings`) and how it is read: :func:`load_config` and
:func:`settings_from_mapping`, whose :class:`ConfigError` names the offending field path.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from disagg_router.router.config._base import Frozen, deprecated_keys
from disagg_router.router.config.health import HealthConfig, LoadSignalsConfig
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
from disagg_router.router.config.pools import PoolConfig
from disagg_router.router.config.push import PushConfig
from disagg_router.router.config.telemetry import LoggingConfig, TracingConfig
from disagg_router.router.config.tenants import TenancyConfig
from disagg_router.router.config.timeouts import TimeoutsConfig
from disagg_router.router.errors import ConfigError


class ReloadConfig(Frozen):
    """Hot reload: SIGHUP always re-reads the file; ``watch`` also re-reads it when it changes."""

    watch: bool = False


def _models_shape(value: Any) -> str:
    return "map" if isinstance(value, dict) else "list"


ModelsField = Annotated[
    Annotated[list[str], Tag("list")] | Annotated[dict[str, ModelConfig], Tag("map")],
    Discriminator(_models_shape),
]


class RouterSettings(Frozen):
    """The whole file. ``models`` is either a list of names served by the top-level ``prefill`` and
    ``decode`` pools (the short form) or a map from each name to its own pools (then the
    top-level pools must be absent)."""

    models: ModelsField
    mode: Mode = "push"
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    kv_events: KvEventsConfig = KvEventsConfig()
    passthrough_pool: PassthroughPool = Field(
        default="decode",
        description="the pool (prefill or decode) whose instances serve the non-generation "
        "routes (/tokenize, /detokenize, /v1/embeddings, pooling, scoring, rerank); a model may "
        "name its own",
    )
    load_signals: LoadSignalsConfig = LoadSignalsConfig()
    reload: ReloadConfig = ReloadConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    health: HealthConfig = HealthConfig()
    api_keys: list[str] = Field(default_factory=list)
    retry_on_fresh_pair: bool = True
    migration: MigrationConfig = MigrationConfig()
    push: PushConfig = PushConfig()
    tenancy: TenancyConfig = TenancyConfig()
    admission: AdmissionConfig = AdmissionConfig()
    breaker: BreakerConfig = BreakerConfig()
    limits: LimitsConfig = LimitsConfig()
    drain: DrainConfig = DrainConfig()
    logging: LoggingConfig = LoggingConfig()
    tracing: TracingConfig = TracingConfig()

    @field_validator("models")
    @classmethod
    def _models_nonempty(cls, value: list[str] | dict[str, ModelConfig]) -> Any:
        if not value:
            raise ValueError("at least one model is required")
        if any(not m.strip() for m in value):
            raise ValueError("model names must be non-empty")
        if isinstance(value, list) and len(set(value)) != len(value):
            raise ValueError("model names must be distinct")
        return value

    @model_validator(mode="after")
    def _pools_match_models(self) -> RouterSettings:
        short = isinstance(self.models, list)
        for role in ("prefill", "decode"):
            given = getattr(self, role) is not None
            if short and not given:
                raise ValueError(f"{role}: required when models is a list of names")
            if not short and given:
                raise ValueError(f"{role}: not allowed when models is a map; give it per model")
        return self

    @model_validator(mode="after")
    def _tenant_models_served(self) -> RouterSettings:
        served = set(self.models)
        limits = [(t.name, t) for t in self.tenancy.tenants] + [("default", self.tenancy.default)]
        for name, tenant in limits:
            unknown = sorted(set(tenant.models or ()) - served)
            if unknown:
                raise ValueError(f"tenancy: tenant {name} names unserved models {unknown}")
        return self

    @property
    def model_names(self) -> list[str]:
        """Served model names in file order."""
        return list(self.models)

    def routes(self) -> dict[str, ModelRoute]:
        """The effective per-model table (pools, policies, disaggregation rule)."""
        if isinstance(self.models, list):
            assert self.prefill is not None and self.decode is not None
            return {
                m: ModelRoute(
                    m,
                    self.prefill,
                    self.decode,
                    self.disaggregation,
                    self.kv_events,
                    self.passthrough_pool,
                )
                for m in self.models
            }
        return {
            m: ModelRoute(
                m,
                c.prefill,
                c.decode,
                c.disaggregation or self.disaggregation,
                c.kv_events or self.kv_events,
                c.passthrough_pool or self.passthrough_pool,
            )
            for m, c in self.models.items()
        }

    @field_validator("api_keys")
    @classmethod
    def _keys_nonempty(cls, value: list[str]) -> list[str]:
        if any(not k for k in value):
            raise ValueError("api keys must be non-empty strings")
        return value


_ROOT_FIELD = re.compile(r"^(?:Value error, )?([a-z_][\w.]*): (.+)$", re.DOTALL)


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts = list(loc)
    if len(parts) > 1 and parts[0] == "models" and parts[1] in ("list", "map"):
        del parts[1]  # the discriminator tag of the two shapes of ``models``
    return ".".join(str(p) for p in parts) or "<root>"


def settings_from_mapping(data: Any) -> RouterSettings:
    """Validate a parsed mapping; raise :class:`ConfigError` naming the first offending field."""
    if not isinstance(data, dict):
        raise ConfigError("<root>", "config must be a mapping (YAML object)")
    try:
        return RouterSettings.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        path, msg = _field_path(tuple(err["loc"])), str(err["msg"])
        named = _ROOT_FIELD.match(msg) if path == "<root>" else None
        if named:  # a whole-file rule that names its field in the message
            path, msg = named.group(1), named.group(2)
        raise ConfigError(path, msg) from exc


def _log_deprecated(message: str) -> None:
    logging.getLogger("disagg_router.router.config").warning("%s", message)


def load_config(
    path: str | Path, on_deprecated: Callable[[str], None] = _log_deprecated
) -> RouterSettings:
    """Read and validate a YAML config file; :class:`ConfigError` on any problem.

    Each deprecated key the file still uses (:data:`RENAMED_KEYS`) is handed to ``on_deprecated``
    as one message naming old -> new (default: a warning on this module's logger), only once the
    file is valid."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError("<file>", f"cannot read {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"invalid YAML: {exc}") from exc
    settings = settings_from_mapping(data)
    for message in deprecated_keys(data):
        on_deprecated(message)
    return settings
