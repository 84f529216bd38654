"""Transfer efficiency with P at tensor parallelism: ``p_tp`` P ranks WRITE into one D (TP 1).

Who calls it: :mod:`bench.transfer` (``disagg-bench transfer --p-tp N``, kinds ``bare`` and
``connector``) and :mod:`bench.device_check` (``--tp N``). Each P rank holds one KV head of
``spec.share_bytes`` per block, so D's block is the ranks' shares side by side; every iteration
each rank WRITEs its share of the first ``blocks_per_write`` blocks of every region, at its
offset inside D's blocks, with a notification.

- ``connector``: :class:`disagg_router.connector.nixl_backend.NixlEndpoint` on both sides; each rank
  states its rank and head range in its :class:`disagg_router.connector.layout.LayoutSpec` and takes
  its descriptors from the connector's head mapping
  (:func:`disagg_router.connector.layout.head_transfer`, its narrowed views and
  :func:`disagg_router.connector.layout.descriptor_index`), as the producer does for a registration.
- ``bare``: raw agent calls (:mod:`bench.bare_nixl`); D's descriptors for rank ``r`` are plain
  arithmetic: ``share_bytes`` at ``block * block_bytes + r * share_bytes``.

D drives: it stamps the start, tells every rank "go", and the iteration ends when D holds the
notification of every rank (``time.perf_counter`` in D's process only). After the last one D
checks that each written block holds every rank's fill byte in its share and the rest is zero.
Memory is host memory (``cpu``) or one CUDA device (``cuda:N``; the device check).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Literal

from bench.transfer_spec import TransferSpec, await_report, bare_positions, write_stats

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from disagg_router.connector.layout import Descriptor, LayoutSpec

TpKind = Literal["bare", "connector"]
_POLL_S = 0.0001
_RUN_S = 600.0


def _layout(
    spec: TransferSpec, addr: int, rank: int, size: int, memory: tuple[str, int]
) -> LayoutSpec:
    from disagg_router.connector.layout import LayoutSpec, RegionSpec

    block = spec.share_bytes * (spec.p_tp // size)
    region_bytes = spec.blocks_per_region * block
    return LayoutSpec(
        tuple(
            RegionSpec(addr + r * region_bytes, block, block, spec.blocks_per_region)
            for r in range(spec.regions)
        ),
        mem_type=memory[0],  # type: ignore[arg-type]
        device_id=memory[1],
        head_bytes=spec.share_bytes,
        tp_rank=rank,
        tp_size=size,
        total_kv_heads=spec.p_tp,
    )


def d_layout(spec: TransferSpec, addr: int, memory: tuple[str, int] = ("DRAM", 0)) -> LayoutSpec:
    """D's layout (TP 1, all ``p_tp`` heads) over its buffer at ``addr``; ``memory`` is the
    NIXL memory type and device id."""
    return _layout(spec, addr, 0, 1, memory)


def p_layout(
    spec: TransferSpec, rank: int, addr: int, memory: tuple[str, int] = ("DRAM", 0)
) -> LayoutSpec:
    """P rank ``rank``'s layout (one head per block) over its buffer at ``addr``."""
    return _layout(spec, addr, rank, spec.p_tp, memory)


def connector_share(p: LayoutSpec, d: LayoutSpec) -> tuple[LayoutSpec, LayoutSpec]:
    """``(P's, D's)`` views the rank's WRITE uses: the connector's head mapping, as the
    producer prepares them for a registration. Raises ``ValueError`` when it refuses."""
    from disagg_router.connector.layout import head_transfer

    transfer = head_transfer(p, d)
    if isinstance(transfer, str):
        raise ValueError(f"the connector refuses P rank {p.tp_rank}: {transfer}")
    return transfer.views(p, d)


def connector_remote_descs(spec: TransferSpec, rank: int, d_addr: int) -> list[Descriptor]:
    """The D descriptors rank ``rank``'s ``connector`` WRITE hits (for tests and readers)."""
    from disagg_router.connector.layout import descriptor_index, descriptors

    _, view = connector_share(p_layout(spec, rank, 0), d_layout(spec, d_addr))
    every = descriptors(view)
    return [every[i] for i in descriptor_index(view, range(spec.blocks_per_write)).tolist()]


def bare_remote_descs(
    spec: TransferSpec, rank: int, d_addr: int, device_id: int = 0
) -> list[Descriptor]:
    """Rank ``rank``'s share of every block of D's buffer at ``d_addr``, region-major (the
    ``bare`` kind's remote descriptor list; it posts :func:`bench.transfer.bare_positions`)."""
    n = spec.regions * spec.blocks_per_region
    share = spec.share_bytes
    return [(d_addr + i * spec.block_bytes + rank * share, share, device_id) for i in range(n)]


def fill_value(rank: int) -> int:
    """The byte P rank ``rank`` fills its buffer with (never 0)."""
    return rank % 255 + 1


def shares_landed(spec: TransferSpec, d_bytes: npt.NDArray[np.uint8]) -> bool:
    """Whether D's buffer holds every rank's fill byte in its share of each written block, and
    zero everywhere else."""
    import numpy as np

    rows = d_bytes.reshape(spec.regions, spec.blocks_per_region, spec.block_bytes)
    fills = np.array([fill_value(r) for r in range(spec.p_tp)], dtype=np.uint8)
    expected = np.repeat(fills, spec.share_bytes)
    written = rows[:, : spec.blocks_per_write]
    return bool((written == expected).all()) and not bool(rows[:, spec.blocks_per_write :].any())


class _Memory:
    """``nbytes`` zeroed bytes on ``device``: ``cpu`` (NumPy, DRAM) or ``cuda:N`` (torch, VRAM)."""

    def __init__(self, nbytes: int, device: str) -> None:
        self._cuda = device.startswith("cuda")
        self._buf: Any
        if self._cuda:
            import torch

            self._buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            self.addr = int(self._buf.data_ptr())
            self.memory = ("VRAM", int(torch.device(device).index or 0))
        else:
            import numpy as np

            self._buf = np.zeros(nbytes, dtype=np.uint8)
            self.addr = int(self._buf.ctypes.data)
            self.memory = ("DRAM", 0)

    def fill(self, value: int) -> None:
        if self._cuda:
            import torch

            self._buf.fill_(value)
            torch.cuda.synchronize(self._buf.device)
        else:
            self._buf.fill(value)

    def host(self) -> npt.NDArray[np.uint8]:
        out: npt.NDArray[np.uint8] = self._buf.cpu().numpy() if self._cuda else self._buf
        return out


class _Rank:
    """One P rank's endpoint, connected to D; :meth:`write` posts its share and waits."""

    def __init__(
        self, kind: TpKind, spec: TransferSpec, rank: int, mem: _Memory, hello: Any
    ) -> None:
        n, dev = spec.regions * spec.blocks_per_region, mem.memory[1]
        name = f"bench-p{rank}-{kind}"
        self.impl: Any
        if kind == "bare":
            from bench.bare_nixl import BareNixlEndpoint, contiguous_descs

            spans = [(mem.addr, n * spec.share_bytes, dev)]
            local = contiguous_descs(mem.addr, spec.share_bytes, n, dev)
            self.impl = BareNixlEndpoint(name, local, mem.memory[0], spans=spans)
            remote = bare_remote_descs(spec, rank, hello["addr"], hello["memory"][1])
            self.impl.connect(hello["metadata"], remote, hello["memory"][0])
            ids = bare_positions(spec)
            self._post: Callable[[bytes], Any] = lambda notif: self.impl.write(ids, notif)
            return
        from disagg_router.connector.layout import LayoutSpec, descriptor_index
        from disagg_router.connector.nixl_backend import NixlEndpoint

        p = p_layout(spec, rank, mem.addr, mem.memory)
        p_view, d_view = connector_share(p, LayoutSpec.from_json(hello["layout"]))
        self.impl = NixlEndpoint(name, p)
        self.impl.prepare_remote(hello["name"], hello["metadata"], d_view, local=p_view)
        self.impl.connect(hello["name"])
        blocks = range(spec.blocks_per_write)
        local_ids, remote_ids = descriptor_index(p, blocks), descriptor_index(d_view, blocks)
        self._post = lambda notif: self.impl.write(hello["name"], local_ids, remote_ids, notif)

    def write(self, notif: bytes) -> None:
        handle = self._post(notif)
        while (state := self.impl.state(handle)) == "PROC":
            pass
        self.impl.release(handle)
        if state != "DONE":
            raise RuntimeError(f"WRITE ended in state {state}")


def _rank_main(kind: TpKind, spec: TransferSpec, rank: int, device: str, d: Connection) -> None:
    mem = _Memory(spec.regions * spec.blocks_per_region * spec.share_bytes, device)
    mem.fill(fill_value(rank))
    ep = _Rank(kind, spec, rank, mem, d.recv())
    d.send("ready")
    while (msg := d.recv()) != "stop":
        ep.write(f"it-{msg}-r{rank}".encode())
    ep.impl.close()
    d.send("bye")


def _iteration(i: int, ranks: Sequence[Connection], notifs: Callable[[], list[bytes]]) -> float:
    """Tell every rank to WRITE; the seconds until D holds every rank's notification."""
    want = {f"it-{i}-r{r}".encode() for r in range(len(ranks))}
    deadline = time.monotonic() + _RUN_S
    start = time.perf_counter()
    for conn in ranks:
        conn.send(i)
    while want:
        want.difference_update(notifs())
        if want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"iteration {i}: no notification from {sorted(want)}")
            time.sleep(_POLL_S)
    return time.perf_counter() - start


def _target_main(
    kind: TpKind, spec: TransferSpec, device: str, ranks: list[Connection], report: Connection
) -> None:
    n, block = spec.regions * spec.blocks_per_region, spec.block_bytes
    mem = _Memory(n * block, device)
    name = f"bench-d-{kind}"
    layout = d_layout(spec, mem.addr, mem.memory)
    impl: Any
    if kind == "bare":
        from bench.bare_nixl import BareNixlEndpoint, contiguous_descs

        descs = contiguous_descs(mem.addr, block, n, mem.memory[1])
        impl = BareNixlEndpoint(
            name, descs, mem.memory[0], spans=[(mem.addr, n * block, mem.memory[1])]
        )
        notifs = impl.notifs
    else:
        from disagg_router.connector.nixl_backend import NixlEndpoint

        impl = NixlEndpoint(name, layout)
        notifs = impl.take_notifs
    hello = {"name": name, "metadata": impl.metadata(), "addr": mem.addr, "memory": mem.memory}
    for conn in ranks:
        conn.send({**hello, "layout": layout.to_json()})
    for conn in ranks:
        conn.recv()  # "ready": connected
    times = [_iteration(i, ranks, notifs) for i in range(spec.warmups + spec.iterations)]
    exact = shares_landed(spec, mem.host())
    for conn in ranks:
        conn.send("stop")
    for conn in ranks:
        conn.recv()  # "bye": closed, before D tears down
    impl.close()
    # Every iteration ended with every rank's notification in hand.
    report.send({"times": times[spec.warmups :], "complete": len(times), "byte_exact": exact})


def run_tp_kind(kind: TpKind, spec: TransferSpec, device: str = "cpu") -> dict[str, Any]:
    """One round of one kind: D and ``spec.p_tp`` P ranks in fresh processes; returns the
    throughput of whole blocks (every rank's share), latency and ``byte_exact``."""
    spec.validate()
    ctx = mp.get_context("spawn")
    report_recv, report_send = ctx.Pipe(duplex=False)
    pipes = [ctx.Pipe() for _ in range(spec.p_tp)]
    procs = [
        ctx.Process(
            target=_target_main,
            args=(kind, spec, device, [d for _, d in pipes], report_send),
            name="target",
        ),
        *(
            ctx.Process(target=_rank_main, args=(kind, spec, r, device, p), name=f"p-rank-{r}")
            for r, (p, _) in enumerate(pipes)
        ),
    ]
    for proc in procs:
        proc.start()
    try:
        result: dict[str, Any] = await_report(kind, report_recv, procs)
    finally:
        for proc in procs:
            proc.join(timeout=30.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    iterations = spec.warmups + spec.iterations
    return {
        "kind": kind,
        "p_tp": spec.p_tp,
        **write_stats(spec, result["times"]),
        "notifications_received": result["complete"] * spec.p_tp,
        "notifications_expected": iterations * spec.p_tp,
        "byte_exact": result["byte_exact"],
    }
