"""KV caches for the device check, shaped the way vLLM allocates them on CUDA by default.

One allocation per instance in vLLM's default CUDA layout ``LBNHC`` (layers outermost, then
blocks, tokens, heads, K+V content), handed to the connector as vLLM does: one ``[B, H, N, C]``
view per layer. P fills every block with a byte pattern derived from (layer, block); D checks the
bytes of the blocks it received against the pattern of the P blocks they came from, and that the
blocks nothing wrote into are still zero. torch only (CUDA or CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CHECK_CHUNK = 128  # blocks compared at a time (bounds the extra memory of a check)


@dataclass(frozen=True)
class CacheShape:
    """A model's KV cache geometry: ``layers`` x ``num_blocks`` blocks of ``block_size`` tokens."""

    layers: int
    heads: int
    block_size: int
    content: int
    """Elements per token and head: K and V (vLLM packs both: head_size + head_size_v)."""
    num_blocks: int
    dtype: str = "bfloat16"

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        elem = int(torch.empty(0, dtype=getattr(torch, self.dtype)).element_size())
        return self.heads * self.block_size * self.content * elem

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers (what a transfer moves per block)."""
        return self.layers * self.page_bytes


class KVCache:
    """One instance's KV cache on ``device`` (``cuda:N`` or ``cpu``), zero-filled."""

    def __init__(self, shape: CacheShape, device: str) -> None:
        self.shape = shape
        s = shape
        dims = (s.layers, s.num_blocks, s.block_size, s.heads, s.content)
        self.raw = torch.zeros(dims, dtype=getattr(torch, s.dtype), device=device)
        self.views = {
            f"model.layers.{layer}.self_attn.attn": self.raw[layer].permute(0, 2, 1, 3)
            for layer in range(s.layers)
        }
        self.bytes = self.raw.view(torch.uint8).reshape(s.layers, s.num_blocks, s.page_bytes)
        self._base = (torch.arange(s.page_bytes, device=device) % 251).to(torch.uint8)

    def _offsets(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[layers, len(blocks), 1]`` uint8 offset of each (layer, block) in the pattern."""
        layers = torch.arange(self.shape.layers, device=blocks.device)[:, None]
        return ((layers * 131 + blocks[None, :] * 7 + 1) % 256).to(torch.uint8)[:, :, None]

    def fill_pattern(self) -> None:
        """P: block ``b`` of layer ``l`` holds ``(i % 251 + 131 l + 7 b + 1) mod 256`` at byte i."""
        blocks = torch.arange(self.shape.num_blocks, device=self.raw.device)
        s = self.shape
        base = self._base.expand(s.layers, s.num_blocks, s.page_bytes)
        torch.add(base, self._offsets(blocks), out=self.bytes)
        self.sync()

    def holds(self, d_blocks: list[int], p_blocks: list[int]) -> bool:
        """D: whether each of ``d_blocks`` holds, byte for byte, P's block at the same index."""
        self.sync()
        for i in range(0, len(d_blocks), _CHECK_CHUNK):
            d = torch.tensor(d_blocks[i : i + _CHECK_CHUNK], device=self.raw.device)
            p = torch.tensor(p_blocks[i : i + _CHECK_CHUNK], device=self.raw.device)
            expected = self._base[None, None, :] + self._offsets(p)
            if not torch.equal(self.bytes[:, d, :], expected):
                return False
        return True

    def zero_except(self, written: set[int]) -> bool:
        """D: whether every block outside ``written`` is still all zero."""
        self.sync()
        rest = [b for b in range(self.shape.num_blocks) if b not in written]
        for i in range(0, len(rest), _CHECK_CHUNK):
            idx = torch.tensor(rest[i : i + _CHECK_CHUNK], device=self.raw.device)
            if bool(self.bytes[:, idx, :].any()):
                return False
        return True

    def sync(self) -> None:
        """Wait for the device's queued work (a no-op on CPU)."""
        if self.raw.is_cuda:
            torch.cuda.synchronize(self.raw.device)
