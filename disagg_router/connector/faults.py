"""Test-only fault injection: a NIXL error in P's writer mid-transfer, on a real vLLM.

Who calls it: the worker, once, when it creates P's transfer core (:func:`wrap`); nothing else
in the connector knows about it. It is off unless ``kv_connector_extra_config`` sets
``fault_injection_file`` (never set it in production): P's endpoint is then wrapped so that the
first WRITE posted after that file appears (the file is removed, so each file injects once)
fails like a WRITE NIXL accepted and then lost: the post returns a handle but moves no data,
polling that handle raises :class:`~disagg_router.connector.errors.TransferError`, and so does the
writer's next ``progress()``. The fault-matrix tests create the file right before the request they
fault.
"""

from __future__ import annotations

import os

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.endpoint import Endpoint, XferState
from disagg_router.connector.errors import TransferError
from disagg_router.connector.layout import DescriptorIndex, LayoutSpec

INJECTED = "injected fault: NIXL error mid-transfer"
"""The message of every injected error (the logs and failure reasons carry it)."""


class _LostWrite:
    """The handle of a WRITE the fault swallowed."""


class FaultInjectingEndpoint:
    """An :class:`~disagg_router.connector.endpoint.Endpoint` that delegates to ``inner`` except for
    the injected fault (see the module docstring)."""

    def __init__(self, inner: Endpoint, trigger_file: str) -> None:
        self._inner = inner
        self._trigger = trigger_file
        self._progress_fault = False

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def layout(self) -> LayoutSpec:
        return self._inner.layout

    def metadata(self) -> bytes:
        return self._inner.metadata()

    def prepare_remote(
        self, agent_name: str, metadata: bytes, layout: LayoutSpec, local: LayoutSpec | None = None
    ) -> None:
        self._inner.prepare_remote(agent_name, metadata, layout, local=local)

    def connect(self, agent_name: str) -> None:
        self._inner.connect(agent_name)

    def _armed(self) -> bool:
        """Whether the trigger file was there (and is now consumed)."""
        try:
            os.remove(self._trigger)
        except FileNotFoundError:
            return False
        return True

    def write(
        self, agent_name: str, local_ids: DescriptorIndex, remote_ids: DescriptorIndex, notif: bytes
    ) -> object:
        if self._armed():
            self._progress_fault = True
            return _LostWrite()
        return self._inner.write(agent_name, local_ids, remote_ids, notif)

    def state(self, handle: object) -> XferState:
        if isinstance(handle, _LostWrite):
            raise TransferError(INJECTED)
        return self._inner.state(handle)

    def release(self, handle: object) -> None:
        if not isinstance(handle, _LostWrite):
            self._inner.release(handle)

    def send_notif(self, agent_name: str, message: bytes) -> None:
        self._inner.send_notif(agent_name, message)

    def take_notifs(self) -> list[bytes]:
        return self._inner.take_notifs()

    def progress(self) -> None:
        if self._progress_fault:
            self._progress_fault = False
            raise TransferError(INJECTED)
        self._inner.progress()


def wrap(endpoint: Endpoint, config: ConnectorConfig) -> Endpoint:
    """``endpoint``, wrapped for fault injection only when ``fault_injection_file`` is set."""
    if not config.fault_injection_file:
        return endpoint
    return FaultInjectingEndpoint(endpoint, config.fault_injection_file)
