"""Bare NIXL for the transfer benchmarks and the device check: the bench's baseline.

Just the raw agent calls a KV WRITE needs (register, prepare descriptor lists, prepped WRITE,
poll), with no connector code in between, so it serves as the baseline the connector's WRITE path
is compared with. NIXL itself comes from :func:`disagg_router.connector.nixl_backend.nixl_api` (the
``nixl`` package, or a CUDA wheel such as ``nixl-cu13`` installed alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from disagg_router.connector.nixl_backend import nixl_api

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

Descs = Sequence[tuple[int, int, int]]
"""``(address, length, device id)`` per descriptor."""
Positions: TypeAlias = "npt.NDArray[np.int32]"
"""Descriptor positions as NIXL takes them fastest (a list is converted element by element)."""


def positions(ids: Sequence[int]) -> Positions:
    """``ids`` as the int32 array :meth:`BareNixlEndpoint.write` posts without converting."""
    import numpy as np

    return np.asarray(ids, dtype=np.int32)


def contiguous_descs(
    addr: int, desc_bytes: int, num_descs: int, device_id: int = 0
) -> list[tuple[int, int, int]]:
    """One buffer at ``addr`` (on ``device_id``; 0 for DRAM) split into ``num_descs`` equal
    descriptors."""
    return [(addr + i * desc_bytes, desc_bytes, device_id) for i in range(num_descs)]


class BareNixlEndpoint:
    """One agent with ``spans`` registered as ``mem_type`` and ``descs`` prepared over them.

    ``spans`` default to one registration per descriptor.
    """

    def __init__(
        self, name: str, descs: Descs, mem_type: str = "DRAM", spans: Descs | None = None
    ) -> None:
        api = nixl_api()
        self.name = name
        self._agent: Any = api.nixl_agent(
            name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        regs = [(a, n, dev, "") for a, n, dev in (spans if spans is not None else descs)]
        self._reg = self._agent.register_memory(regs, mem_type)
        local = self._agent.get_xfer_descs(list(descs), mem_type)
        self._local: Any = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local)
        self._remote: Any = None
        self._peer = ""

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def connect(self, metadata: bytes, remote_descs: Descs, remote_mem_type: str = "DRAM") -> None:
        """Load the peer, prepare its descriptors and open the connection."""
        peer = self._agent.add_remote_agent(metadata)
        self._peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        descs = self._agent.get_xfer_descs(list(remote_descs), remote_mem_type)
        self._remote = self._agent.prep_xfer_dlist(self._peer, descs)
        self._agent.make_connection(self._peer)

    def write(self, ids: Positions, notif: bytes, remote_ids: Positions | None = None) -> Any:
        """Post a WRITE of local descriptors ``ids`` into the peer's ``remote_ids`` (default:
        the same indices)."""
        handle = self._agent.make_prepped_xfer(
            "WRITE",
            self._local,
            ids,
            self._remote,
            ids if remote_ids is None else remote_ids,
            notif_msg=notif,
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
