"""Device check: the connector's transfer core moving KV between two processes, on GPU or host.

Run on a GPU machine (VRAM: both KV caches on ``cuda:N``) or anywhere (``--memory dram``, what CI
runs). Two OS processes, P and D (:mod:`bench.device_peers`), each with a KV cache shaped like
vLLM's (:mod:`bench.device_kv`) registered through our ``NixlEndpoint``:

1. byte checks through the whole connector path (D registers with ``PushConsumer``, P finishes
   with ``PushProducer``, D learns the KV landed): 1 block, many scattered blocks, and a big
   transfer (>= 1 GiB on VRAM); D's blocks must equal P's byte for byte, the rest stay zero;
2. throughput of that path vs a bare NIXL WRITE (+ notification) of the same descriptors, from
   "P starts" to "D knows", median of ``--iterations``;
3. with ``--tp N``: the same throughput with P at tensor parallelism (:mod:`bench.transfer_tp`):
   N P rank processes each WRITE their share of every block (``1/N`` of its KV heads, at their
   offset in D's block) into one D, the connector's ``NixlEndpoint`` with its head mapping vs
   bare NIXL, until D holds every rank's notification; D's blocks are then checked byte for
   byte;
4. one JSON line on stdout with both GB/s and their ratio; exit 1 if a byte check failed.

It needs only the standard library, torch, the connector's vLLM-free transfer core and NIXL. A
bare GPU machine without NIXL takes the wheel carried to it (``--wheel``): its sha256 is checked
against the pins below, then it is installed into ``--wheel-dir`` (``pip install --no-deps
--target``) and imported from there. Fetch it where there is network with::

    pip download nixl-cu13==1.5.1 --no-deps --only-binary=:all: \\
        --python-version 3.11 --platform manylinux_2_28_x86_64 -d wheels/

(``--python-version`` of the GPU machine's python: 3.10 to 3.13 are pinned.) Then::

    python -m bench.device_check --wheel wheels/nixl_cu13-1.5.1-cp311-*.whl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.device_kv import CacheShape
from disagg_router.connector.layout import LayoutSpec, descriptor_ids

NIXL_WHEEL_SHA256 = {
    "nixl_cu13-1.5.1-cp310-cp310-manylinux_2_28_x86_64.whl": (
        "8a5be349e3de2a6734e947882716f7cb45bae9c6af942bdcb83ee80fda4edf5c"
    ),
    "nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl": (
        "6279834382eeabab60bfc2fe62c2363cda3bf520278bbd4a007932cc76073de5"
    ),
    "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl": (
        "ce48b601bad4c4503a5d9d418e6f4b1289a3a68e407af99f0f7e377f8371f49b"
    ),
    "nixl_cu13-1.5.1-cp313-cp313-manylinux_2_28_x86_64.whl": (
        "a19951cbee1a2e77a988076d8329d60b9fa667247e7918fb0bd6dbbb3e761c27"
    ),
}
"""sha256 of NIXL's CUDA 13 wheels, as ``pip download nixl-cu13==1.5.1`` fetches them."""

MIB = 1024 * 1024
_REPLY_S = 300.0


def install_wheel(wheel: Path, target: Path) -> str:
    """Check ``wheel`` against :data:`NIXL_WHEEL_SHA256`, install it into ``target`` (once) and
    put ``target`` first on ``sys.path`` (child processes inherit it); returns the sha256."""
    want = NIXL_WHEEL_SHA256.get(wheel.name)
    if want is None:
        raise SystemExit(f"{wheel.name}: not a pinned NIXL wheel ({sorted(NIXL_WHEEL_SHA256)})")
    got = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if got != want:
        raise SystemExit(f"{wheel.name}: sha256 {got} is not the pinned {want}")
    if not (target / "nixl_cu13").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        subprocess.run([*cmd, str(wheel)], check=True, timeout=600)
    sys.path.insert(0, str(target))
    return got


def _ask(conn: Connection, *cmd: Any) -> Any:
    conn.send(cmd)
    if not conn.poll(_REPLY_S):
        raise TimeoutError(f"{cmd[0]}: no reply within {_REPLY_S} s")
    return conn.recv()


class Peers:
    """The P and D processes of one check, and the commands the check sends them."""

    def __init__(self, shape: CacheShape, device: str, poll_s: float | None = None) -> None:
        from bench.device_peers import consumer_main, producer_main

        ctx = mp.get_context("spawn")
        self.p, p_end = ctx.Pipe()
        self.d, d_end = ctx.Pipe()
        self.procs = [
            ctx.Process(target=producer_main, args=(p_end, shape, device, poll_s), name="check-p"),
            ctx.Process(target=consumer_main, args=(d_end, shape, device, poll_s), name="check-d"),
        ]
        for proc in self.procs:
            proc.start()
        p_end.close()  # so a peer that dies shows as EOF here
        d_end.close()
        self.p_hello = _reply(self.p)
        self.d_hello = _reply(self.d)
        self.p_layout = LayoutSpec.from_json(self.p_hello["layout"])
        self.d_layout = LayoutSpec.from_json(self.d_hello["layout"])
        self._key = 0

    def _next(self) -> int:
        self._key += 1
        return self._key

    def transfer(self, p_blocks: list[int], d_blocks: list[int]) -> tuple[float, bool]:
        """Through the connector: D registers, P finishes; ``(P finish -> D knows, ok)``."""
        i = self._next()
        _ask(self.d, "register", i, self.p_hello["port"], d_blocks)
        t0: float = _ask(self.p, "finish", i, p_blocks)
        t1, ok = _ask(self.d, "wait", i)
        return t1 - t0, bool(ok)

    def verify(self, p_blocks: list[int], d_blocks: list[int], written: set[int]) -> Any:
        return _ask(self.d, "verify", d_blocks, p_blocks, written)

    def to_bare(self) -> None:
        """Close the connector on both sides; bare agents register the same memory."""
        _ask(self.p, "bare_open")
        d_meta = _ask(self.d, "bare_open")
        _ask(self.p, "bare_connect", d_meta, self.d_hello["layout"])

    def bare_transfer(self, p_blocks: list[int], d_blocks: list[int]) -> float:
        """One bare WRITE of the same descriptors: P posts -> D has the notification."""
        i = self._next()
        p_ids = descriptor_ids(self.p_layout, p_blocks)
        d_ids = descriptor_ids(self.d_layout, d_blocks)
        t0: float = _ask(self.p, "bare_write", i, p_ids, d_ids)
        t1, _ = _ask(self.d, "bare_wait", i)
        return float(t1 - t0)

    def close(self) -> list[str]:
        """Stop both peers; returns the foreign packages either of them imported."""
        foreign = set(_ask(self.p, "exit")) | set(_ask(self.d, "exit"))
        for proc in self.procs:
            proc.join(timeout=30)
        return sorted(foreign)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def _reply(conn: Connection) -> Any:
    if not conn.poll(_REPLY_S):
        raise TimeoutError(f"no reply within {_REPLY_S} s")
    return conn.recv()


def byte_checks(peers: Peers, shape: CacheShape, big_blocks: int) -> list[dict[str, Any]]:
    """1 block, 64 scattered blocks, ``big_blocks`` blocks; each checked byte for byte."""
    n = shape.num_blocks
    cases = {
        "1 block": ([5], [2]),
        "64 scattered blocks": ([1 + 2 * i for i in range(64)], [n - 1 - 3 * i for i in range(64)]),
        f"{big_blocks} blocks": (
            list(range(big_blocks)),
            list(range(n - 1, n - 1 - big_blocks, -1)),
        ),
    }
    written: set[int] = set()
    out = []
    for name, (p_blocks, d_blocks) in cases.items():
        seconds, ok = peers.transfer(p_blocks, d_blocks)
        written.update(d_blocks)
        checked = peers.verify(p_blocks, d_blocks, written)
        out.append(
            {
                "case": name,
                "bytes": len(d_blocks) * shape.block_bytes,
                "ok": ok,
                **checked,
                "seconds": round(seconds, 6),
            }
        )
    return out


def _median_gbps(nbytes: int, times: list[float]) -> tuple[float, float]:
    median = statistics.median(times)
    return nbytes / median / 1e9, median * 1e3


def throughput(
    peers: Peers, shape: CacheShape, sizes: list[int], args: Any
) -> list[dict[str, Any]]:
    """Median GB/s of the connector path and of bare NIXL for each size (connector first)."""
    runs = args.warmups + args.iterations
    plans = {s: list(range(max(1, s // shape.block_bytes))) for s in sizes}
    ours = {
        s: [peers.transfer(b, b)[0] for _ in range(runs)][args.warmups :] for s, b in plans.items()
    }
    peers.to_bare()
    bare = {
        s: [peers.bare_transfer(b, b) for _ in range(runs)][args.warmups :]
        for s, b in plans.items()
    }
    rows = []
    for s, blocks in plans.items():
        nbytes = len(blocks) * shape.block_bytes
        ours_gbps, ours_ms = _median_gbps(nbytes, ours[s])
        bare_gbps, bare_ms = _median_gbps(nbytes, bare[s])
        rows.append(
            {
                "bytes": nbytes,
                "ours_gbps": round(ours_gbps, 3),
                "bare_gbps": round(bare_gbps, 3),
                "ratio": round(ours_gbps / bare_gbps, 3),
                "ours_median_ms": round(ours_ms, 3),
                "bare_median_ms": round(bare_ms, 3),
            }
        )
    return rows


def tp_throughput(
    shape: CacheShape, sizes: list[int], args: Any, device: str
) -> list[dict[str, Any]]:
    """``--tp N``: per size, median GB/s of N P ranks writing their shares into one D,
    connector (NixlEndpoint, the connector's head mapping) vs bare NIXL."""
    from bench.transfer_spec import TransferSpec
    from bench.transfer_tp import run_tp_kind

    rows = []
    for size in sizes:
        blocks = max(1, size // shape.block_bytes)
        spec = TransferSpec(
            regions=shape.layers,
            blocks_per_region=blocks,
            block_bytes=shape.page_bytes,
            blocks_per_write=blocks,
            iterations=args.iterations,
            warmups=args.warmups,
            rounds=1,
            p_tp=args.tp,
        )
        ours, bare = (run_tp_kind(kind, spec, device) for kind in ("connector", "bare"))
        ours_gbps, bare_gbps = ours["median_throughput_gbps"], bare["median_throughput_gbps"]
        rows.append(
            {
                "bytes": spec.bytes_per_write,
                "p_tp": args.tp,
                "ours_gbps": round(ours_gbps, 3),
                "bare_gbps": round(bare_gbps, 3),
                "ratio": round(ours_gbps / bare_gbps, 3),
                "ours_median_ms": round(ours["median_write_ms"], 3),
                "bare_median_ms": round(bare["median_write_ms"], 3),
                "byte_exact": ours["byte_exact"] and bare["byte_exact"],
            }
        )
    return rows


def _shape(memory: str, big_blocks: int) -> CacheShape:
    """VRAM: 4 layers x 8 heads x 16 tokens x 256 (bf16): 256 KiB per block. DRAM: 32 KiB."""
    room = max(big_blocks + 64, 3 * 64)  # "64 scattered blocks" reaches 189 below the last
    if memory == "vram":
        return CacheShape(layers=4, heads=8, block_size=16, content=256, num_blocks=room)
    return CacheShape(layers=2, heads=4, block_size=16, content=128, num_blocks=room)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.device_check", description=__doc__)
    parser.add_argument("--memory", choices=("vram", "dram"), default="vram")
    parser.add_argument("--gpu", type=int, default=0, help="CUDA device index (vram)")
    parser.add_argument("--wheel", type=Path, help="NIXL wheel carried to this machine")
    parser.add_argument(
        "--wheel-dir",
        type=Path,
        default=Path.home() / ".cache" / "disagg-router" / "nixl-cu13-1.5.1",
        help="where --wheel is installed (pip --target)",
    )
    parser.add_argument("--big-mib", type=int, help="size of the big byte check (1024; dram 64)")
    parser.add_argument("--sizes-mib", help="throughput sizes (64,1024; dram 4,16)")
    parser.add_argument(
        "--poll-s",
        type=float,
        help="the connector's writer_poll_s and receiver_poll_s (default: the connector's own); "
        "what the connector adds to a WRITE is mostly these cadences",
    )
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="also measure the throughput with P at this tensor-parallel size: N P ranks WRITE "
        "their share of every block into one D (must divide the cache's KV heads)",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace, wheel_sha256: str | None) -> dict[str, Any]:
    """The whole check; returns the JSON line's object."""
    import torch

    vram = args.memory == "vram"
    if vram and not torch.cuda.is_available():
        raise SystemExit("--memory vram needs CUDA (torch.cuda.is_available() is False)")
    big_mib = args.big_mib or (1024 if vram else 64)
    sizes = [int(x) * MIB for x in (args.sizes_mib or ("64,1024" if vram else "4,16")).split(",")]
    probe = _shape(args.memory, 1)
    big_blocks = max(1, big_mib * MIB // probe.block_bytes)
    shape = _shape(args.memory, max(big_blocks, max(sizes) // probe.block_bytes))
    if args.tp < 1 or shape.heads % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the cache's {shape.heads} KV heads")
    device = f"cuda:{args.gpu}" if vram else "cpu"
    started = time.monotonic()
    peers = Peers(shape, device, args.poll_s)
    try:
        cases = byte_checks(peers, shape, big_blocks)
        rows = throughput(peers, shape, sizes, args)
        foreign = peers.close()
    finally:
        peers.kill()
    tp_rows = tp_throughput(shape, sizes, args, device) if args.tp > 1 else []
    top = rows[-1]
    return {
        "check": "device",
        "memory": "VRAM" if vram else "DRAM",
        "device": torch.cuda.get_device_name(args.gpu) if vram else "cpu",
        "nixl": peers.p_hello["nixl"],
        "wheel_sha256": wheel_sha256,
        "byte_exact": all(c["ok"] and c["exact"] and c["rest_zero"] for c in cases)
        and all(r["byte_exact"] for r in tp_rows),
        "cases": cases,
        "bytes_per_write": top["bytes"],
        "ours_gbps": top["ours_gbps"],
        "bare_gbps": top["bare_gbps"],
        "ratio": top["ratio"],
        "throughput": rows,
        "poll_s": args.poll_s,
        "tp": args.tp,
        "tp_ratio": tp_rows[-1]["ratio"] if tp_rows else None,
        "tp_throughput": tp_rows,
        "foreign_modules": foreign,
        "seconds": round(time.monotonic() - started, 1),
        "command": "python -m bench.device_check " + " ".join(sys.argv[1:]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sha = install_wheel(args.wheel, args.wheel_dir) if args.wheel else None
    result = run(args, sha)
    print(json.dumps(result), flush=True)
    return 0 if result["byte_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
