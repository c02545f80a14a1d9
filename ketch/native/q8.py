"""A matrix as int8 blocks of 32 with an fp16 scale each (GGUF's Q8_0 form), packed for ketch's C
product (q8_matmul.c): the CPU's batch-1 LM head, half the bytes of bf16.

`NativeQ8.quantize(w)` rounds a dense matrix the way Q8_0 does (scale = the block's max |w| / 127
in fp16, q = round(w / scale)): a head that came from a Q8_0 GGUF (SmolLM2's) gets its file's
int8 values back, not a second rounding. `matmul(x)` is x @ W^T for bf16 or fp32 rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ketch.native import blocks
from ketch.native.blocks import BLOCK, TILE, per_lane


def available() -> bool:
    return blocks.library("q8") is not None


@dataclass(frozen=True)
class NativeQ8:
    records: torch.Tensor  # uint8 [tiles, in / 32, 544]: q8_matmul.c's layout
    out_features: int
    in_features: int

    @staticmethod
    def quantize(w: torch.Tensor, chunk_rows: int = 8192) -> "NativeQ8":
        n, k = w.shape
        if k % BLOCK:
            raise ValueError(f"NativeQ8: in_features {k} is not a multiple of {BLOCK}")
        tiles, nb = -(-n // TILE), k // BLOCK
        parts = []
        for start in range(0, tiles * TILE, chunk_rows):  # no fp32 copy of the whole matrix
            rows = w[start : start + chunk_rows].float()
            rows = torch.nn.functional.pad(rows, (0, 0, 0, min(chunk_rows, tiles * TILE - start) - rows.shape[0]))
            blocks_ = rows.view(-1, nb, BLOCK)
            scale = (blocks_.abs().amax(-1) / 127).half().float()  # [rows, nb]
            q = torch.where(scale[..., None] > 0, torch.round(blocks_ / scale[..., None].clamp_min(1e-30)), 0.0)
            q = q.clamp_(-127, 127).to(torch.int8)
            t = rows.shape[0] // TILE
            # [tile, lane, block, run, byte]: byte p of a run's word holds weight 4 run + (0, 2, 1, 3)[p]
            q = q.view(t, TILE, nb, 8, 4)[..., [0, 2, 1, 3]]
            runs = q.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).view(t, nb, 8 * 64)
            parts.append(torch.cat((runs, per_lane(scale, t)), dim=2))
        return NativeQ8(torch.cat(parts).contiguous(), n, k)

    def dequantize(self) -> torch.Tensor:
        """The matrix the records hold, fp32 [out, in] (tests)."""
        tiles, nb = self.records.shape[:2]
        runs = self.records[..., : 8 * 64].contiguous().view(torch.int8).view(tiles, nb, 8, TILE, 4)
        q = runs[..., [0, 2, 1, 3]].permute(0, 3, 1, 2, 4).reshape(tiles * TILE, nb, BLOCK).float()
        scale = self.records[..., 8 * 64 :].contiguous().view(torch.float16).view(tiles, nb, TILE)
        w = q * scale.float().permute(0, 2, 1).reshape(tiles * TILE, nb, 1)
        return w.reshape(tiles * TILE, -1)[: self.out_features]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return blocks.matmul("q8", x, self.records, self.out_features)
