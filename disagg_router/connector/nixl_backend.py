"""The one place that imports NIXL: :class:`NixlEndpoint`, a typed wrapper around ``nixl_agent``.

Who calls it: the worker (one endpoint per worker), the device check and the transfer benchmark.
It implements :class:`disagg_router.connector.endpoint.Endpoint`. Memory is registered as the layout
says: ``DRAM`` for a host KV cache, ``VRAM`` with the CUDA device id for a GPU one; a peer's
descriptors are prepared with the peer's memory type and device id.

Thread safety: NIXL agents tolerate calls from several threads, but every call for one endpoint
runs behind :attr:`NixlEndpoint.lock` so the writer/receiver threads and the side channel never
interleave descriptor preparation. Every NIXL failure surfaces as
:class:`~disagg_router.connector.errors.TransferError`.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from disagg_router.connector.endpoint import XferState
from disagg_router.connector.errors import NixlUnavailableError, TransferError
from disagg_router.connector.layout import DescriptorIndex, LayoutSpec, descriptors, memory_spans


def _load_nixl() -> tuple[ModuleType | None, ImportError | None]:
    """NIXL's Python API: the ``nixl`` meta package, else a CUDA wheel installed alone
    (``nixl-cu13``/``nixl-cu12``, as carried to a bare GPU machine)."""
    error: ImportError | None = None
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name), None
        except ImportError as exc:  # pragma: no cover - depends on the environment
            error = error or exc
    return None, error


_API, _NIXL_IMPORT_ERROR = _load_nixl()
_NIXL_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, ValueError, TypeError)
if _API is not None:
    _bindings = importlib.import_module(_API.__name__.rsplit(".", 1)[0] + "._bindings")
    _NIXL_ERRORS += tuple(
        cls
        for cls in vars(_bindings).values()
        if isinstance(cls, type) and issubclass(cls, Exception)
    )


def nixl_available() -> bool:
    """Whether the NIXL Python bindings import on this machine."""
    return _API is not None


def nixl_api() -> ModuleType:
    """NIXL's Python API module (``nixl_agent``, ``nixl_agent_config``), whichever package
    provided it; raises :class:`NixlUnavailableError`. For callers that drive NIXL directly
    (the benchmarks' bare-NIXL baseline)."""
    if _API is None:
        raise NixlUnavailableError(f"NIXL is not importable: {_NIXL_IMPORT_ERROR}")
    return _API


@contextmanager
def _nixl(what: str) -> Iterator[None]:
    """Turn NIXL's exceptions (plain ``Exception`` subclasses of its bindings) into
    :class:`TransferError`."""
    try:
        yield
    except _NIXL_ERRORS as exc:
        raise TransferError(f"NIXL {what} failed: {exc}") from exc


class NixlEndpoint:
    """One NIXL agent (UCX backend) with the local KV layout registered and prepared.

    Contract: create once per worker, :meth:`close` once. Remote descriptor lists are cached
    per remote agent name (``prepare_remote`` is idempotent per agent).
    """

    def __init__(self, name: str, layout: LayoutSpec, *, progress_thread: bool = False) -> None:
        """``progress_thread``: start NIXL's own UCX progress thread. Off by default: nixl 1.5.1's
        Python API hard-codes that thread's delay to 0, so it polls without sleeping and burns a
        whole core per agent; our writer and receiver threads already drive UCX progress through
        ``check_xfer_state`` and ``get_new_notifs`` at their own (bounded) cadence."""
        api = nixl_api()
        self._name = name
        self._layout = layout
        self.lock = threading.RLock()
        with _nixl("agent creation"):
            self._agent: Any = api.nixl_agent(
                name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
            )
        dev = layout.device_id
        with _nixl(f"{layout.mem_type} registration"):
            self._reg = self._agent.register_memory(
                [(addr, length, dev, "") for addr, length in memory_spans(layout)],
                layout.mem_type,
            )
            local = self._agent.get_xfer_descs(descriptors(layout), layout.mem_type)
            self._local_handle: Any = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local)
        self._remote_handles: dict[str, Any] = {}
        self._local_views: dict[LayoutSpec, Any] = {layout: self._local_handle}
        self._peer_local: dict[str, Any] = {}  # agent -> local handle its WRITEs use
        self._unread: list[bytes] = []

    @property
    def name(self) -> str:
        return self._name

    @property
    def layout(self) -> LayoutSpec:
        return self._layout

    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's :meth:`prepare_remote`."""
        with self.lock, _nixl("metadata"):
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's agent metadata (enough to send it notifications); returns its name."""
        with self.lock, _nixl("add_remote_agent"):
            name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def prepare_remote(
        self, agent_name: str, metadata: bytes, layout: LayoutSpec, local: LayoutSpec | None = None
    ) -> None:
        """Load a peer and prepare a descriptor list over its ``layout`` (once per agent), and
        a local one over ``local`` for WRITEs to it (once per distinct view; default: the
        whole local layout). Both views keep the full layouts' descriptor positions."""
        with self.lock:
            if agent_name in self._remote_handles:
                return
            view = local or self._layout
            if view not in self._local_views:
                with _nixl("local descriptor list"):
                    descs = self._agent.get_xfer_descs(descriptors(view), view.mem_type)
                    self._local_views[view] = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs)
            self._peer_local[agent_name] = self._local_views[view]
            loaded = self.add_peer(metadata)
            if loaded != agent_name:
                raise TransferError(f"agent metadata names {loaded!r}, expected {agent_name!r}")
            with _nixl("remote descriptor list"):
                remote = self._agent.get_xfer_descs(descriptors(layout), layout.mem_type)
                self._remote_handles[agent_name] = self._agent.prep_xfer_dlist(agent_name, remote)

    def connect(self, agent_name: str) -> None:
        """Open the backend connection to a loaded peer now (else the first use pays for it)."""
        with self.lock, _nixl("make_connection"):
            self._agent.make_connection(agent_name)

    def write(
        self,
        agent_name: str,
        local_ids: DescriptorIndex,
        remote_ids: DescriptorIndex,
        notif: bytes,
    ) -> Any:
        """Post a WRITE of local descriptors into the peer's; ``notif`` arrives after the data."""
        with self.lock, _nixl("WRITE"):
            handle = self._agent.make_prepped_xfer(
                "WRITE",
                self._peer_local[agent_name],
                local_ids,
                self._remote_handles[agent_name],
                remote_ids,
                notif_msg=notif,
            )
            state = self._agent.transfer(handle)
            if state == "ERR":
                self._agent.release_xfer_handle(handle)
                raise TransferError("NIXL rejected the WRITE")
            return handle

    def state(self, handle: Any) -> XferState:
        with self.lock, _nixl("check_xfer_state"):
            state = str(self._agent.check_xfer_state(handle))
        if state not in ("DONE", "PROC", "ERR"):
            return "ERR"
        return state  # type: ignore[return-value]

    def release(self, handle: Any) -> None:
        with self.lock, _nixl("release_xfer_handle"):
            self._agent.release_xfer_handle(handle)

    def send_notif(self, agent_name: str, message: bytes) -> None:
        with self.lock, _nixl("send_notif"):
            self._agent.send_notif(agent_name, message)

    def take_notifs(self) -> list[bytes]:
        """All notifications received since the last call (any peer), progress() included."""
        with self.lock:
            self._collect_notifs()
            out, self._unread = self._unread, []
        return out

    def progress(self) -> None:
        """Drive UCX progress once, so posted notifications leave and WRITEs advance.

        Without NIXL's progress thread nothing else moves a send that no one polls: the
        producer calls this on every writer step. Notifications it picks up are kept for the
        next :meth:`take_notifs` (a ``kv_both`` endpoint serves both sides).
        """
        with self.lock:
            self._collect_notifs()

    def _collect_notifs(self) -> None:
        with _nixl("get_new_notifs"):
            raw: dict[str, list[bytes]] = self._agent.get_new_notifs()
        self._unread.extend(m for msgs in raw.values() for m in msgs)

    def forget_peer(self, agent_name: str) -> None:
        with self.lock, _nixl("remove_remote_agent"):
            handle = self._remote_handles.pop(agent_name, None)
            self._peer_local.pop(agent_name, None)
            if handle is not None:
                self._agent.release_dlist_handle(handle)
            self._agent.remove_remote_agent(agent_name)

    def close(self) -> None:
        with self.lock:
            for name in list(self._remote_handles):
                self.forget_peer(name)
            with _nixl("deregistration"):
                for handle in self._local_views.values():
                    self._agent.release_dlist_handle(handle)
                self._agent.deregister_memory(self._reg)
