"""Router configuration: pydantic models loaded from YAML.

Who calls it: ``disagg-router serve``/``check-config`` (:mod:`router.cli`) and hot reload
(:mod:`router.reload`) via :func:`load_config`, and tests (which build :class:`RouterSettings`
directly). Models are frozen; every field is validated, unknown keys
are rejected, and :class:`ConfigError` names the offending field path (``prefill.instances.0.url``).
No timeout may be infinite: each is a positive number of seconds.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from router.errors import ConfigError

PolicyName = Literal[
    "round_robin",
    "least_in_flight",
    "power_of_two",
    "prefix_affinity",
    "session_affinity",
    "kv_aware",
]
Mode = Literal["push", "pull"]
PassthroughPool = Literal["prefill", "decode"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PushIdentity(_Frozen):
    """A prefill instance's NIXL identity as the decode side needs it (push mode)."""

    engine_id: str = Field(min_length=1)
    host: str = Field(min_length=1, description="NIXL side-channel host of the P instance")
    port: int = Field(ge=1, le=65535, description="NIXL side-channel port of the P instance")
    tp_size: int = Field(default=1, ge=1)
    pp_size: int = Field(default=1, ge=1)


class InstanceConfig(_Frozen):
    """One vLLM instance; ``identity`` only matters for prefill instances."""

    url: str
    name: str | None = None
    identity: PushIdentity | None = None
    api_key: str | None = Field(default=None, description="sent as Bearer token to this instance")
    kv_events_endpoint: str | None = Field(
        default=None,
        description="ZMQ endpoint of this instance's KV event publisher (kv_events); default "
        "tcp://<url host>:<kv_events.events_port>",
    )
    kv_replay_endpoint: str | None = Field(
        default=None,
        description="ZMQ endpoint of this instance's KV event replay socket (kv_events); "
        "default tcp://<url host>:<kv_events.replay_port>",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http(s) URL with a host, e.g. http://127.0.0.1:8100")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError("must be a base URL without path, query or fragment")
        return value.rstrip("/")

    @property
    def label(self) -> str:
        """Stable name used in metrics and logs."""
        return self.name or self.url


# --- discovery: where a pool's instances come from -------------------------------------------


class StaticDiscovery(_Frozen):
    """The pool's ``instances`` list is the whole, fixed set (the default)."""

    source: Literal["static"] = "static"


class DnsDiscovery(_Frozen):
    """Every A/AAAA record of ``name`` is an instance (a headless Service), re-resolved each
    ``interval``; with ``srv: true`` the SRV records of ``name`` give targets and ports instead.

    ``nameservers`` empty: the system resolver (``/etc/resolv.conf``, with its search domains).
    """

    source: Literal["dns"]
    name: str = Field(min_length=1, description="DNS name, e.g. disagg-decode.ns.svc.cluster.local")
    port: int | None = Field(default=None, ge=1, le=65535, description="instance port (A/AAAA)")
    srv: bool = False
    scheme: Literal["http", "https"] = "http"
    interval: float = Field(default=5.0, gt=0, description="seconds between resolutions")
    timeout: float = Field(default=2.0, gt=0, description="seconds for one resolution")
    nameservers: list[str] = Field(default_factory=list, description="resolver IPs to ask")
    nameserver_port: int = Field(default=53, ge=1, le=65535)
    api_key: str | None = Field(default=None, description="Bearer token for every instance")

    @model_validator(mode="after")
    def _port_source(self) -> DnsDiscovery:
        if self.srv == (self.port is not None):
            raise ValueError("give either port (A/AAAA records) or srv: true (ports from SRV)")
        return self


class KubernetesDiscovery(_Frozen):
    """Instances from the Kubernetes API, listed then watched: the ready endpoints of the
    EndpointSlices (``resource: endpointslices``, select a Service's slices with
    ``kubernetes.io/service-name=NAME``) or the ready pods (``resource: pods``) matching
    ``selector`` in ``namespace``. Auth: the pod's service account (``in_cluster``) or a
    kubeconfig file (``kubeconfig``; null path: the client's default)."""

    source: Literal["kubernetes"]
    namespace: str | None = Field(
        default=None, min_length=1, description="null: the router pod's own (in_cluster only)"
    )
    selector: str = Field(min_length=1, description="label selector, e.g. app=vllm,role=decode")
    resource: Literal["endpointslices", "pods"] = "endpointslices"
    port: int | str = Field(description="port number, or (endpointslices) the port's name")
    scheme: Literal["http", "https"] = "http"
    auth: Literal["in_cluster", "kubeconfig"] = "in_cluster"
    kubeconfig: str | None = None
    watch_timeout: float = Field(default=240.0, gt=0, description="seconds one watch call lasts")
    retry_interval: float = Field(default=5.0, gt=0, description="seconds before a relist")
    request_timeout: float = Field(default=30.0, gt=0, description="seconds for one list call")
    api_key: str | None = Field(default=None, description="Bearer token for every instance")

    @field_validator("port")
    @classmethod
    def _port(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 65535:
            raise ValueError("port numbers are 1..65535")
        if isinstance(value, str) and not value:
            raise ValueError("a port name must be non-empty")
        return value

    @model_validator(mode="after")
    def _port_kind(self) -> KubernetesDiscovery:
        if self.resource == "pods" and not isinstance(self.port, int):
            raise ValueError("resource pods needs a port number")
        if self.namespace is None and self.auth != "in_cluster":
            raise ValueError("namespace is required with kubeconfig auth")
        return self


DiscoveryConfig = Annotated[
    StaticDiscovery | DnsDiscovery | KubernetesDiscovery, Field(discriminator="source")
]


class ShapeConfig(_Frozen):
    """The engine shape a pool's instances are expected to have; only ``check-config`` reads it
    (at run time the identity probes learn each instance's own)."""

    tp_size: int = Field(default=1, ge=1, description="tensor parallel size")
    pp_size: int = Field(default=1, ge=1, description="pipeline parallel size")
    block_size: int = Field(default=16, ge=1, description="KV block size in tokens")
    num_kv_heads: int | None = Field(
        default=None, ge=1, description="the model's KV heads (null: not declared)"
    )


class PoolConfig(_Frozen):
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


# --- renamed keys: an old name is accepted for one release, then removed ----------------------

RENAMED_KEYS: dict[str, dict[str, str]] = {
    "timeouts": {"discovery": "identity_probe"},
    "health": {"discovery_interval": "identity_interval", "discovery_prompt": "identity_prompt"},
}
"""Per section, old key -> new key ("discovery" names pool membership only; identity probing has
its own keys). An old key is read as its new one; giving both is an error naming both."""


def _renamed_keys(section: str, data: Any) -> Any:
    """``data`` with the section's old keys under their new names; ValueError if both given."""
    renamed = RENAMED_KEYS[section]
    if not isinstance(data, dict) or not renamed.keys() & data.keys():
        return data
    out = dict(data)
    for old, new in renamed.items():
        if old in out and new in out:
            raise ValueError(
                f"{section}.{old} is the deprecated name of {section}.{new}: give only {new}"
            )
        if old in out:
            out[new] = out.pop(old)
    return out


def deprecated_keys(data: Any) -> list[str]:
    """One warning per old key a parsed config still uses, naming old -> new.

    Who calls it: :func:`load_config` (which hands each to its ``on_deprecated``)."""
    found = []
    for section, renamed in RENAMED_KEYS.items():
        given = data.get(section) if isinstance(data, dict) else None
        for old, new in renamed.items():
            if isinstance(given, dict) and old in given:
                found.append(
                    f"config key {section}.{old} is deprecated: use {section}.{new} "
                    "(the old name is still read in this release)"
                )
    return found


class TimeoutsConfig(_Frozen):
    """Seconds; all finite and positive.

    ``connect``: TCP connect to an instance. ``prefill``: the whole P leg. ``first_token``: from
    dispatch until D's first token. ``total``: the whole request, end to end. ``health``: one
    ``/health`` call. ``identity_probe``: one identity probe (a 1-token prefill on P).
    ``inter_token``: the longest silence of D in a stream after its first token.
    """

    connect: float = Field(default=5.0, gt=0)
    prefill: float = Field(default=120.0, gt=0)
    first_token: float = Field(default=180.0, gt=0)
    total: float = Field(default=600.0, gt=0)
    health: float = Field(default=10.0, gt=0)
    identity_probe: float = Field(
        default=60.0, gt=0, description="seconds for one identity probe (old name: discovery)"
    )
    inter_token: float = Field(
        default=60.0,
        gt=0,
        description=(
            "a streamed answer whose D sends nothing for this long after its first token ends "
            "with one SSE error event, counted against D's breaker"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return _renamed_keys("timeouts", data)

    @model_validator(mode="after")
    def _consistent(self) -> TimeoutsConfig:
        if self.total < self.first_token or self.total < self.prefill:
            raise ValueError("total must be >= first_token and >= prefill")
        return self


class HealthConfig(_Frozen):
    interval: float = Field(default=10.0, gt=0, description="seconds between health checks")
    unhealthy_interval: float = Field(
        default=1.0, gt=0, description="seconds between checks while any backend is unhealthy"
    )
    identity_interval: float | None = Field(
        default=300.0,
        gt=0,
        description=(
            "seconds between identity probes of a healthy prefill instance (push mode); "
            "null: probe only at start and when an instance (re)joins "
            "(old name: discovery_interval)"
        ),
    )
    identity_prompt: str = Field(
        default="ping",
        min_length=1,
        description="prompt of the identity probe (old name: discovery_prompt)",
    )
    failure_threshold: int = Field(
        default=2, ge=1, description="consecutive timed-out checks that take a backend out"
    )
    startup_wait: float = Field(
        default=5.0,
        gt=0,
        description=(
            "seconds a request that arrives before the first health check has finished waits "
            "for it (not at all once the health monitor has crashed)"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return _renamed_keys("health", data)


class AdmissionConfig(_Frozen):
    """Per-instance admission: at most ``max_in_flight`` legs at once on one instance; up to
    ``queue_size`` more wait at most ``max_wait`` seconds for a slot; beyond that a 429 with
    ``Retry-After: retry_after``."""

    max_in_flight: int = Field(default=256, ge=1)
    queue_size: int = Field(default=512, ge=0)
    max_wait: float = Field(default=10.0, gt=0)
    retry_after: int = Field(default=1, ge=1, description="seconds, sent as Retry-After")


class BreakerConfig(_Frozen):
    """Passive health: ``failure_threshold`` consecutive failed legs (5xx, timeouts, refused
    connections, protocol errors) open an instance's breaker for ``backoff`` seconds, doubling on
    each failed half-open trial up to ``max_backoff``; an unreachable instance opens it at once."""

    failure_threshold: int = Field(default=3, ge=1)
    backoff: float = Field(default=1.0, gt=0)
    max_backoff: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> BreakerConfig:
        if self.max_backoff < self.backoff:
            raise ValueError("max_backoff must be >= backoff")
        return self


class LimitsConfig(_Frozen):
    """Client-side bounds. ``max_body_bytes``: larger bodies get 413. ``body_timeout``: seconds
    to receive the whole body (408 after). ``max_header_bytes``: the request line plus headers
    (431 after). ``max_json_depth``: nesting of the JSON body. ``max_tokens``: the largest
    ``max_tokens``/``max_completion_tokens`` accepted. ``docs``: serve /docs, /redoc and
    /openapi.json."""

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    body_timeout: float = Field(default=30.0, gt=0)
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    max_json_depth: int = Field(default=32, ge=4)
    max_tokens: int = Field(default=1_000_000, ge=1)
    docs: bool = False
    keep_alive: float = Field(
        default=75.0,
        gt=0,
        description=(
            "seconds an idle client connection is kept open; longer than clients' own idle "
            "expiry (httpx: 5 s), so a client never sends on a connection the router is closing"
        ),
    )
    header_timeout: float = Field(
        default=10.0,
        gt=0,
        description=(
            "seconds from a request's first byte to the end of its headers; after that the "
            "client gets 408 and the connection is closed"
        ),
    )
    idle_connection_timeout: float = Field(
        default=15.0,
        gt=0,
        description=(
            "seconds a new client connection may stay without sending a request; then it is "
            "closed without an answer"
        ),
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description=(
            "client connections open at once; one opened beyond gets 503 with Retry-After: 1 "
            "and is closed at once"
        ),
    )


class DrainConfig(_Frozen):
    """On SIGTERM/SIGINT: /ready answers 503 and new requests 503 at once; requests in flight get
    ``timeout`` seconds to finish, then their legs are cancelled."""

    timeout: float = Field(default=30.0, gt=0)


class LoggingConfig(_Frozen):
    """``format``: text or json (one object per line: request id, model, P, D, outcome, stage
    timings on the request summary lines). ``requests``: log one summary line per request."""

    format: Literal["text", "json"] = "text"
    requests: bool = True


class TracingConfig(_Frozen):
    """OpenTelemetry tracing (needs the ``tracing`` extra); off by default and then free.
    ``endpoint``: OTLP/HTTP traces URL. W3C ``traceparent`` is propagated to both legs."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = Field(default="disagg-router", min_length=1)
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    export_timeout: float = Field(default=10.0, gt=0)


class DisaggregationConfig(_Frozen):
    """Per model: whether a request uses a P at all.

    ``min_prompt_tokens``: prompts estimated shorter than this go to D alone (D prefills
    locally; no P leg, no transfer); 0 disaggregates every request. Token-id prompts count their
    ids; text is estimated as ``characters / chars_per_token``. ``when_no_prefill``: with no
    usable P, ``decode_only`` serves the request by D alone, ``fail`` answers 503.
    """

    min_prompt_tokens: int = Field(default=0, ge=0)
    chars_per_token: float = Field(default=4.0, gt=0)
    when_no_prefill: Literal["decode_only", "fail"] = "decode_only"


class KvEventsConfig(_Frozen):
    """KV-aware routing of one model: the router subscribes to every P and D instance's vLLM KV
    events (``--kv-events-config``) and computes each request's block keys with the model's
    tokenizer; the ``kv_aware`` policy and the cached D-only rule use them (docs/router.md,
    "KV-aware routing")."""

    enabled: bool = Field(default=False, description="subscribe to the instances' KV events")
    tokenizer: str | None = Field(
        default=None,
        description="local directory of the model's tokenizer and chat template (never "
        "downloaded); required when enabled",
    )
    events_port: int = Field(
        default=5557, ge=1, le=65535, description="publisher port on each instance's host"
    )
    replay_port: int = Field(
        default=5558, ge=1, le=65535, description="replay port on each instance's host"
    )
    topic: str = Field(default="", description="the publisher's topic")
    max_blocks_per_instance: int = Field(
        default=131072, ge=1, description="index bound per instance (oldest blocks forgotten)"
    )
    max_message_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="largest KV event message taken from a publisher (bigger ones are skipped)",
    )
    max_blocks_per_event: int = Field(
        default=32768,
        ge=1,
        description="most block hashes one KV event may carry (a bigger event is skipped)",
    )
    probe_interval: float = Field(
        default=5.0, gt=0, description="seconds of silence before the replay socket is probed"
    )
    probe_timeout: float = Field(
        default=2.0, gt=0, description="seconds a probe or replay may take before degraded"
    )
    decode_only_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="serve by D alone when a usable D holds at least this fraction of the "
        "prompt's tokens (0: never)",
    )
    tokenize_cache_entries: int = Field(
        default=4096, ge=0, description="rendered prompts whose token ids are kept (LRU)"
    )
    max_prompt_chars: int = Field(
        default=262144, ge=1024, description="prompt text tokenized for routing at most"
    )

    @model_validator(mode="after")
    def _tokenizer_given(self) -> KvEventsConfig:
        if self.enabled and not self.tokenizer:
            raise ValueError("tokenizer: required when kv_events is enabled")
        return self


class ModelConfig(_Frozen):
    """One served model: its own P and D pools; ``disaggregation`` and ``kv_events`` default to
    the top-level ones."""

    prefill: PoolConfig
    decode: PoolConfig
    disaggregation: DisaggregationConfig | None = None
    kv_events: KvEventsConfig | None = None
    passthrough_pool: PassthroughPool | None = Field(
        default=None,
        description="the pool serving this model's non-generation routes; null: the top-level "
        "passthrough_pool",
    )


class LoadSignalsConfig(_Frozen):
    """Scraping of each instance's ``/metrics`` for ``power_of_two`` (only pools using it).

    ``interval``: seconds between scrapes; ``stale_after``: older signals are ignored (the policy
    falls back to the router's in-flight counts).
    """

    interval: float = Field(default=2.0, gt=0)
    stale_after: float = Field(default=6.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> LoadSignalsConfig:
        if self.stale_after < self.interval:
            raise ValueError("stale_after must be >= interval")
        return self


class ReloadConfig(_Frozen):
    """Hot reload: SIGHUP always re-reads the file; ``watch`` also re-reads it when it changes."""

    watch: bool = False


@dataclass(frozen=True)
class ModelRoute:
    """The effective routing of one model: its pools and its disaggregation rule."""

    model: str
    prefill: PoolConfig
    decode: PoolConfig
    disaggregation: DisaggregationConfig
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    passthrough_pool: PassthroughPool = "decode"


def _models_shape(value: Any) -> str:
    return "map" if isinstance(value, dict) else "list"


ModelsField = Annotated[
    Annotated[list[str], Tag("list")] | Annotated[dict[str, ModelConfig], Tag("map")],
    Discriminator(_models_shape),
]


class RouterSettings(_Frozen):
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
    logging.getLogger(__name__).warning("%s", message)


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
