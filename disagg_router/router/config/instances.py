"""One vLLM instance of a pool: its URL, name, key, KV event endpoints and (P, push) identity."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import (
    Field,
    field_validator,
)

from disagg_router.router.config._base import Frozen


class PushIdentity(Frozen):
    """A prefill instance's NIXL identity as the decode side needs it (push mode)."""

    engine_id: str = Field(min_length=1)
    host: str = Field(min_length=1, description="NIXL side-channel host of the P instance")
    port: int = Field(ge=1, le=65535, description="NIXL side-channel port of the P instance")
    tp_size: int = Field(default=1, ge=1)
    pp_size: int = Field(default=1, ge=1)


class InstanceConfig(Frozen):
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
