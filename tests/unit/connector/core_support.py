"""Support for the transfer-core unit tests: an in-memory endpoint, a fake clock, a wait helper.

:class:`MemoryEndpoint` implements :class:`disagg_router.connector.endpoint.Endpoint` (mypy checks
it, see ``_conforms``) and behaves like ``NixlEndpoint`` without NIXL's progress thread: a posted
WRITE reports ``write_state`` (``DONE`` by default) when polled, a sent notification leaves (lands
in ``notifs``) only when ``progress`` runs, and ``take_notifs`` returns what ``deliver`` put in.
``progress_errors`` and ``notif_errors`` are raised, one per call, by ``progress`` and
``take_notifs`` (a NIXL error is a :class:`TransferError`; anything else stands for a bug).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from disagg_router.connector.endpoint import Endpoint, XferState
from disagg_router.connector.errors import TransferError
from disagg_router.connector.layout import DescriptorIndex, LayoutSpec, RegionSpec
from disagg_router.connector.protocol import Notification, decode_notification
from tests.support.wait import wait_until

LAYOUT = LayoutSpec(regions=(RegionSpec(0, 64, 64, 32),))


class MemoryEndpoint:
    """See the module docstring; ``fail_writes`` makes every WRITE be refused like NIXL's."""

    def __init__(self, name: str = "p-agent", layout: LayoutSpec = LAYOUT) -> None:
        self.name = name
        self.layout = layout
        self.writes: list[tuple[str, list[int], list[int], Notification]] = []
        self.notifs: list[tuple[str, Notification]] = []
        self.unsent: list[tuple[str, Notification]] = []
        self.inbox: list[bytes] = []
        self.inbox_lock = threading.Lock()
        self.peers: set[str] = set()
        self.views: dict[str, tuple[LayoutSpec, LayoutSpec]] = {}  # agent -> (local, remote)
        self.fail_writes = False
        self.write_state: XferState = "DONE"
        self.writers: list[str] = []  # the thread that posted each WRITE
        self.progress_open = threading.Event()  # clear it to park the next progress() caller
        self.progress_open.set()
        self.in_progress = threading.Event()  # set when a progress() call starts
        self.progress_errors: list[BaseException] = []
        self.notif_errors: list[BaseException] = []

    def metadata(self) -> bytes:
        return b"meta:" + self.name.encode()

    def prepare_remote(
        self, agent_name: str, metadata: bytes, layout: LayoutSpec, local: LayoutSpec | None = None
    ) -> None:
        self.peers.add(agent_name)
        self.views[agent_name] = (local or self.layout, layout)

    def connect(self, agent_name: str) -> None:
        assert agent_name in self.peers

    def write(
        self,
        agent_name: str,
        local_ids: DescriptorIndex,
        remote_ids: DescriptorIndex,
        notif: bytes,
    ) -> int:
        assert agent_name in self.peers
        if self.fail_writes:
            raise TransferError("NIXL rejected the WRITE")
        # NIXL's make_prepped_xfer takes positions as a list or an int32 array.
        assert local_ids.dtype.name == remote_ids.dtype.name == "int32"
        ids = (local_ids.tolist(), remote_ids.tolist())
        self.writes.append((agent_name, *ids, decode_notification(notif)))
        self.writers.append(threading.current_thread().name)
        return len(self.writes)

    def state(self, handle: object) -> XferState:
        return self.write_state

    def release(self, handle: object) -> None:
        pass

    def send_notif(self, agent_name: str, message: bytes) -> None:
        self.unsent.append((agent_name, decode_notification(message)))

    def deliver(self, message: bytes) -> None:
        """A peer's notification arrives (read by the next ``take_notifs``)."""
        with self.inbox_lock:
            self.inbox.append(message)

    def take_notifs(self) -> list[bytes]:
        if self.notif_errors:
            raise self.notif_errors.pop(0)
        with self.inbox_lock:
            out, self.inbox = self.inbox, []
        return out

    def progress(self) -> None:
        if self.progress_errors:
            raise self.progress_errors.pop(0)
        self.in_progress.set()
        assert self.progress_open.wait(10), "progress() parked for 10 s"
        self.notifs.extend(self.unsent)
        self.unsent.clear()


def _conforms(endpoint: MemoryEndpoint) -> Endpoint:
    return endpoint


class FakeClock:
    """A monotonic clock that moves only when a test sets ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    """Wait for a state a background thread reaches (fails the test after ``timeout``)."""
    wait_until(cond, timeout=timeout, what="a state the background thread reaches", interval=0.005)
