"""What the transfer core needs from a NIXL agent, as a structural type.

:class:`~disagg_router.connector.nixl_backend.NixlEndpoint` is the real implementation; the unit
tests' in-memory endpoints implement the same :class:`Endpoint` protocol, and mypy checks both
against it. The producer and consumer depend only on this protocol, never on NIXL.
"""

from __future__ import annotations

from typing import Literal, Protocol

from disagg_router.connector.layout import DescriptorIndex, LayoutSpec

XferState = Literal["DONE", "PROC", "ERR"]
"""State of a posted WRITE: landed, in progress, failed."""


class Endpoint(Protocol):
    """One agent with the local KV layout registered; see :class:`NixlEndpoint` for the contract.

    Errors: every method raises :class:`~disagg_router.connector.errors.TransferError` when NIXL
    refuses or fails the operation.
    """

    @property
    def name(self) -> str:
        """This agent's name (peers address it by name)."""
        ...

    @property
    def layout(self) -> LayoutSpec:
        """The local KV layout, registered and prepared."""
        ...

    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's :meth:`prepare_remote`."""
        ...

    def prepare_remote(
        self, agent_name: str, metadata: bytes, layout: LayoutSpec, local: LayoutSpec | None = None
    ) -> None:
        """Load a peer and prepare a descriptor list over its ``layout`` (idempotent per peer);
        WRITEs to it take local descriptors over ``local`` (a narrowed view of :attr:`layout`,
        e.g. one KV head of each block; default the whole layout)."""
        ...

    def connect(self, agent_name: str) -> None:
        """Open the backend connection to a loaded peer now (else the first use pays for it)."""
        ...

    def write(
        self,
        agent_name: str,
        local_ids: DescriptorIndex,
        remote_ids: DescriptorIndex,
        notif: bytes,
    ) -> object:
        """Post a WRITE of local descriptors into the peer's (positions from
        :func:`disagg_router.connector.layout.descriptor_index`); ``notif`` arrives after the data.
        Returns a handle for :meth:`state` and :meth:`release`."""
        ...

    def state(self, handle: object) -> XferState:
        """Where a posted WRITE is (also drives the backend's progress)."""
        ...

    def release(self, handle: object) -> None:
        """Free a WRITE handle (once, after ``DONE`` or ``ERR`` or when giving up)."""
        ...

    def send_notif(self, agent_name: str, message: bytes) -> None:
        """Queue a notification to a loaded peer (it leaves on the next progress)."""
        ...

    def take_notifs(self) -> list[bytes]:
        """All notifications received since the last call, from any peer."""
        ...

    def progress(self) -> None:
        """Drive the backend once so queued notifications leave and WRITEs advance."""
        ...
