"""The one place that imports NIXL: a small typed wrapper around ``nixl_agent`` on DRAM.

Who calls it: :mod:`connector.producer` and :mod:`connector.consumer` (one endpoint per worker).
Thread safety: NIXL agents tolerate calls from several threads, but the connector keeps every
call for one endpoint behind :attr:`NixlEndpoint.lock` so the writer/monitor thread and the side
channel never interleave descriptor preparation.

Only ``DRAM`` is exercised here (CPU KV caches). ``VRAM`` registration is the same calls with
``mem_type="VRAM"`` and is untested on these machines.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

from connector.layout import descriptors
from connector.protocol import LayoutSpec

try:  # guarded import: the package stays importable (and unit-testable) without NIXL
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as _exc:  # pragma: no cover - depends on the environment
    _NIXL_IMPORT_ERROR: ImportError | None = _exc
else:
    _NIXL_IMPORT_ERROR = None

XferState = Literal["DONE", "PROC", "ERR"]


class NixlUnavailableError(RuntimeError):
    """NIXL is not installed or could not be loaded."""


def nixl_available() -> bool:
    """Whether the NIXL Python bindings import on this machine."""
    return _NIXL_IMPORT_ERROR is None


class NixlEndpoint:
    """One NIXL agent (UCX backend) with the local KV layout registered and prepared.

    Contract: create once per worker, :meth:`close` once. ``remote`` handles are cached per
    remote agent name (``prepare_remote`` is idempotent per agent).
    """

    def __init__(
        self,
        name: str,
        layout: LayoutSpec,
        mem_type: str = "DRAM",
        *,
        progress_thread: bool = False,
    ) -> None:
        """``progress_thread``: start NIXL's own UCX progress thread. Off by default: nixl 1.5.1's
        Python API hard-codes that thread's delay to 0, so it polls without sleeping and burns a
        whole core per agent; our writer and receiver threads already drive UCX progress through
        ``check_xfer_state`` and ``get_new_notifs`` at their own (bounded) cadence."""
        if _NIXL_IMPORT_ERROR is not None:
            raise NixlUnavailableError(f"NIXL is not importable: {_NIXL_IMPORT_ERROR}")
        self.name = name
        self.layout = layout
        self.mem_type = mem_type
        self.lock = threading.RLock()
        self._agent: Any = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        )
        spans = sorted(
            {
                (r.addr, (r.num_blocks - 1) * r.block_stride + r.block_bytes)
                for r in layout.regions
                if r.num_blocks > 0
            }
        )
        self._reg = self._agent.register_memory(
            [(addr, length, 0, "") for addr, length in spans], mem_type
        )
        local = self._agent.get_xfer_descs(descriptors(layout), mem_type)
        self._local_handle: Any = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local)
        self._remote_handles: dict[str, Any] = {}
        self._unread: list[bytes] = []

    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's :meth:`prepare_remote`."""
        with self.lock:
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's agent metadata (enough to send it notifications); returns its name."""
        with self.lock:
            name = self._agent.add_remote_agent(metadata)
            return name.decode() if isinstance(name, bytes) else str(name)

    def prepare_remote(self, agent_name: str, metadata: bytes, layout: LayoutSpec) -> None:
        """Load a peer and prepare a descriptor list over its ``layout`` (once per agent)."""
        with self.lock:
            if agent_name in self._remote_handles:
                return
            loaded = self.add_peer(metadata)
            if loaded != agent_name:
                raise ValueError(f"agent metadata names {loaded!r}, expected {agent_name!r}")
            remote = self._agent.get_xfer_descs(descriptors(layout), self.mem_type)
            self._remote_handles[agent_name] = self._agent.prep_xfer_dlist(agent_name, remote)

    def connect(self, agent_name: str) -> None:
        """Open the backend connection to a loaded peer now (else the first use pays for it)."""
        with self.lock:
            self._agent.make_connection(agent_name)

    def write(
        self, agent_name: str, local_ids: list[int], remote_ids: list[int], notif: bytes
    ) -> Any:
        """Post a WRITE of local descriptors into the peer's; ``notif`` arrives after the data."""
        with self.lock:
            handle = self._agent.make_prepped_xfer(
                "WRITE",
                self._local_handle,
                local_ids,
                self._remote_handles[agent_name],
                remote_ids,
                notif_msg=notif,
            )
            state = self._agent.transfer(handle)
            if state == "ERR":
                self._agent.release_xfer_handle(handle)
                raise RuntimeError("NIXL rejected the WRITE")
            return handle

    def state(self, handle: Any) -> XferState:
        with self.lock:
            state = str(self._agent.check_xfer_state(handle))
        if state not in ("DONE", "PROC", "ERR"):
            return "ERR"
        return state  # type: ignore[return-value]

    def release(self, handle: Any) -> None:
        with self.lock:
            self._agent.release_xfer_handle(handle)

    def send_notif(self, agent_name: str, message: bytes) -> None:
        with self.lock:
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
        raw: dict[str, list[bytes]] = self._agent.get_new_notifs()
        self._unread.extend(m for msgs in raw.values() for m in msgs)

    def forget_peer(self, agent_name: str) -> None:
        with self.lock:
            handle = self._remote_handles.pop(agent_name, None)
            if handle is not None:
                self._agent.release_dlist_handle(handle)
            self._agent.remove_remote_agent(agent_name)

    def close(self) -> None:
        with self.lock:
            for name in list(self._remote_handles):
                self.forget_peer(name)
            self._agent.release_dlist_handle(self._local_handle)
            self._agent.deregister_memory(self._reg)
