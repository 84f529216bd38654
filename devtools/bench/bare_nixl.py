"""Bare NIXL on DRAM for the transfer benchmark: the one place the bench imports NIXL.

Just the raw agent calls a KV WRITE needs (register, prepare descriptor lists, prepped WRITE,
poll), with no connector code in between, so it serves as the baseline the connector's WRITE path
is compared with.
"""

from __future__ import annotations

from typing import Any

try:  # guarded: the bench package imports without NIXL
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as _exc:  # pragma: no cover - depends on the environment
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None


class BareNixlEndpoint:
    """One agent with one DRAM buffer registered and split into equal descriptors."""

    def __init__(self, name: str, addr: int, desc_bytes: int, num_descs: int) -> None:
        if _IMPORT_ERROR is not None:
            raise RuntimeError(f"NIXL is not importable: {_IMPORT_ERROR}")
        self.name = name
        self._descs = [(addr + i * desc_bytes, desc_bytes, 0) for i in range(num_descs)]
        self._agent: Any = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self._reg = self._agent.register_memory([(addr, desc_bytes * num_descs, 0, "")], "DRAM")
        local = self._agent.get_xfer_descs(self._descs, "DRAM")
        self._local: Any = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local)
        self._remote: Any = None
        self._peer = ""

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def connect(self, metadata: bytes, remote_addr: int) -> None:
        """Load the peer and prepare its descriptors (same sizes and count as ours)."""
        peer = self._agent.add_remote_agent(metadata)
        self._peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        size = self._descs[0][1]
        remote = [(remote_addr + i * size, size, 0) for i in range(len(self._descs))]
        descs = self._agent.get_xfer_descs(remote, "DRAM")
        self._remote = self._agent.prep_xfer_dlist(self._peer, descs)
        self._agent.make_connection(self._peer)

    def write(self, ids: list[int], notif: bytes) -> Any:
        handle = self._agent.make_prepped_xfer(
            "WRITE", self._local, ids, self._remote, ids, notif_msg=notif
        )
        if self._agent.transfer(handle) == "ERR":
            raise RuntimeError("NIXL rejected the WRITE")
        return handle

    def state(self, handle: Any) -> str:
        return str(self._agent.check_xfer_state(handle))

    def release(self, handle: Any) -> None:
        self._agent.release_xfer_handle(handle)

    def notifs(self) -> list[bytes]:
        raw: dict[str, list[bytes]] = self._agent.get_new_notifs()
        return [m for msgs in raw.values() for m in msgs]

    def close(self) -> None:
        if self._remote is not None:
            self._agent.release_dlist_handle(self._remote)
            self._agent.remove_remote_agent(self._peer)
        self._agent.release_dlist_handle(self._local)
        self._agent.deregister_memory(self._reg)
