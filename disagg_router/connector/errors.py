"""The connector's exceptions: one root, :class:`ConnectorError`, one subclass per cause.

Callers branch on the class, never on a message or on ``__cause__``. Each subclass also derives
from the builtin a caller would otherwise expect (``ValueError`` for bad input,
``ConnectionError`` for an unreachable peer, ``RuntimeError`` for NIXL failures).
"""

from __future__ import annotations


class ConnectorError(Exception):
    """Root of every error the connector raises on purpose."""


class ConfigError(ConnectorError, ValueError):
    """A ``kv_connector_extra_config`` field has a bad value; the message names the field."""


class UnsupportedSetupError(ConnectorError):
    """This vLLM instance is set up in a way the connector refuses at start-up (e.g. TP > 1, MLA,
    a KV cache on another device than ``kv_buffer_device``); the message says what and why."""


class LayoutError(ConnectorError, ValueError):
    """The KV cache tensors cannot be described as regions of equally sized blocks."""


class ProtocolError(ConnectorError, ValueError):
    """A message is malformed or speaks an unknown protocol version."""


class SideChannelError(ConnectorError, ConnectionError):
    """The peer's side channel answered nothing usable within the bound (it may be alive)."""


class SideChannelRefusedError(SideChannelError):
    """Nothing listens on the peer's side channel: its process is gone (or never started), so
    it holds no registration of ours and no WRITE from it can land."""


class NixlUnavailableError(ConnectorError, RuntimeError):
    """NIXL is not installed or could not be loaded."""


class TransferError(ConnectorError, RuntimeError):
    """NIXL refused or failed an operation (registration, descriptor list, WRITE, notification)."""


class TransferCoreFailedError(ConnectorError, RuntimeError):
    """A transfer-core thread stopped on an unexpected error; the instance can no longer move
    KV. Raised from the next engine step's worker hook so that vLLM fails the engine and its
    ``/health`` answers 503 (the router then takes the instance out of rotation)."""


class ContractError(ConnectorError, ValueError):
    """``kv_transfer_params`` lack a field the message needs or carry a bad value; the message
    names the field."""
