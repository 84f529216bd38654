"""A served model's own sections: ``disaggregation``, ``kv_events``, its pools and pass-through
pool, and the effective route of each model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from disagg_router.router.config._base import Frozen
from disagg_router.router.config.pools import PoolConfig

Mode = Literal["push", "pull"]


PassthroughPool = Literal["prefill", "decode"]


class DisaggregationConfig(Frozen):
    """Per model: whether a request uses a P at all.

    ``min_prompt_tokens``: prompts estimated shorter than this go to D alone (D prefills
    locally; no P leg, no transfer); 0 disaggregates every request. Token-id prompts count their
    ids; text is estimated as ``characters / chars_per_token``. ``when_no_prefill``: with no
    usable P, ``decode_only`` serves the request by D alone, ``fail`` answers 503.
    """

    min_prompt_tokens: int = Field(default=0, ge=0)
    chars_per_token: float = Field(default=4.0, gt=0)
    when_no_prefill: Literal["decode_only", "fail"] = "decode_only"


class KvEventsConfig(Frozen):
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


class ModelConfig(Frozen):
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


@dataclass(frozen=True)
class ModelRoute:
    """The effective routing of one model: its pools and its disaggregation rule."""

    model: str
    prefill: PoolConfig
    decode: PoolConfig
    disaggregation: DisaggregationConfig
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    passthrough_pool: PassthroughPool = "decode"
