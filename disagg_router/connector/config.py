"""Connector settings parsed from ``kv_connector_extra_config`` (vLLM-independent).

Who calls it: the facade (once per role) and the transfer-core tests. Every failure path has a
bound here; nothing in the connector waits without one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from disagg_router.connector.errors import ConfigError

KV_TRANSFER_CONFIG_KEYS = frozenset(
    {
        "kv_connector",
        "kv_connector_module_path",
        "kv_role",
        "kv_buffer_device",
        "engine_id",
        "kv_connector_extra_config",
    }
)
"""The ``--kv-transfer-config`` keys vLLM and this connector read with ``DisaggPushConnector``
(``kv_buffer_device`` must say where the KV cache is: ``cuda`` on GPU, ``cpu`` on CPU)."""


@dataclass(frozen=True)
class ConnectorConfig:
    """Bounds and addresses of one connector instance (P or D)."""

    side_channel_host: str = "127.0.0.1"
    """Where P's side channel (registrations, cancels, pings) listens; D connects to the params'."""
    side_channel_port: int = 5600
    """P's side-channel port, advertised as ``remote_port`` in its kv_transfer_params."""
    transfer_timeout_s: float = 120.0
    """D: a registered transfer that is neither done nor failed after this long fails. It covers a
    live P whose queue is long (a dead P is caught by the pings within ~1 s), so it is sized like
    a prefill's worst queueing delay, and kept below the router's first-token timeout (180 s)."""
    connect_timeout_s: float = 2.0
    """D: bound on one side-channel request (connect + reply)."""
    liveness_interval_s: float = 0.5
    """D: how often D pings a P it waits on; two failed pings in a row fail its transfers."""
    lease_s: float = 30.0
    """P: a finished prefill whose D never registers is freed after this long."""
    registration_ttl_s: float = 120.0
    """P: a registration whose prefill never finishes gets a fail notification after this long."""
    max_inflight_s: float = 20.0
    """Both: a WRITE not complete after this long is treated as failed (handle released)."""
    writer_poll_s: float = 0.0002
    """P: how often the writer thread polls WRITEs in flight (and drives UCX progress) while it
    has any; it sleeps on an event otherwise. Shorter: lower latency, more of P's core."""
    receiver_poll_s: float = 0.0005
    """D: how often the receiver thread drains NIXL notifications while transfers are pending
    (every 50 ms when none are). vLLM's engine also reads them at each step while a transfer is
    pending (``PushConsumer.take_results``), so this bounds how late D learns of a WRITE only when
    the engine is not stepping. Shorter: more of D's core (measured while one transfer waits:
    1.5 % of a core at 2 ms, 3.6 % at 0.5 ms, 7 % at 0.2 ms)."""
    post_on_finish: bool = False
    """P: post the WRITE on the thread that finishes the prefill (vLLM's worker thread) when its D
    has registered and is already connected, instead of waking the writer thread for it. That
    thread then spends the WRITE's posting (descriptor ids and NIXL's post; with host memory UCX
    copies while posting). Off by default: on host memory it measured no gain (docs/benchmarks,
    "Transfer efficiency")."""
    nixl_progress_thread: bool = False
    """Both: start NIXL's UCX progress thread (it busy-polls a core in nixl 1.5.1; see
    ``disagg_router.connector.nixl_backend``). Off: the connector's own threads drive progress."""
    fault_injection_file: str = ""
    """P, tests only: a path whose appearance makes P's next WRITE fail mid-transfer
    (:mod:`disagg_router.connector.faults`). Empty (the default): no fault injection at all."""

    @staticmethod
    def read_by(name: str) -> Literal["P", "D", "both"]:
        """Which side reads the setting ``name`` (setting it on the other side does nothing)."""
        return _READ_BY[name]

    def __post_init__(self) -> None:
        """Every duration is > 0 and the port is a port number (0: any free port)."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("float", float) and not value > 0:
                raise ConfigError(f"{field.name}: must be > 0, got {value!r}")
        if not 0 <= self.side_channel_port < 65536:
            raise ConfigError(
                f"side_channel_port: must be a port number, got {self.side_channel_port!r}"
            )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Build from vLLM's ``kv_connector_extra_config`` (unknown keys are ignored).

        Values are coerced as JSON and environment strings need (``"2.5"``, ``"true"``,
        ``"18299"``); a bad one raises :class:`ConfigError` naming the field. pydantic does the
        coercion; it is imported here only, so the transfer core runs without it.
        """
        from pydantic import TypeAdapter, ValidationError

        try:
            config: ConnectorConfig = TypeAdapter(cls).validate_python(dict(extra))
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(part) for part in err["loc"])
            if not field:  # raised by __post_init__, which names the field itself
                raise ConfigError(
                    f"kv_connector_extra_config.{err['msg'].removeprefix('Value error, ')}"
                ) from exc
            raise ConfigError(
                f"kv_connector_extra_config.{field}: invalid value {err['input']!r} ({err['msg']})"
            ) from exc
        return config


_READ_BY: dict[str, Literal["P", "D", "both"]] = {
    "side_channel_host": "P",
    "side_channel_port": "P",
    "transfer_timeout_s": "D",
    "connect_timeout_s": "D",
    "liveness_interval_s": "D",
    "lease_s": "P",
    "registration_ttl_s": "P",
    "max_inflight_s": "both",
    "writer_poll_s": "P",
    "receiver_poll_s": "D",
    "post_on_finish": "P",
    "nixl_progress_thread": "both",
    "fault_injection_file": "P",
}
