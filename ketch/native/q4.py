"""4-bit weights packed for ketch's C product (q4_matmul.c: the layout and the arithmetic).

`NativeQ4.pack(q, scale, zero)` turns 4-bit blocks (w = (q - 8) * scale + zero, the form of
ketch.layers.q4.Q4Weight) into the tiled layout, and `matmul(x)` is x @ W^T for bf16 or fp32
rows, the activations rounded to int16 per block (the default) or, opt-in
(`with_activations("int8")`, `--cpu-activations int8`), to int8 as llama.cpp rounds them.
`available()` says whether the library is built here (ketch/native/build.py); without it the
callers keep torch's int4 kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ketch.native import blocks, build
from ketch.native.blocks import BLOCK, DTYPES, TILE, fp16_exact, per_lane

__all__ = ["ACTIVATIONS", "DTYPES", "NativeQ4", "available", "library"]

ACTIVATIONS = {"int16": "", "int8": "_i8"}  # how activations are rounded -> q4_matmul.c's entry point


def library():
    return blocks.library("q4")


def available() -> bool:
    return library() is not None


@dataclass(frozen=True)
class NativeQ4:
    records: torch.Tensor  # uint8 [tiles, in / 32, 320]: q4_matmul.c's layout
    out_features: int
    in_features: int
    activations: str = "int16"  # a key of ACTIVATIONS

    @staticmethod
    def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> "NativeQ4 | None":
        """q [out, in] in 0..15, scale and zero [out, in / 32]: the packed weight, or None when
        its scales or zeros are not fp16 values."""
        n, k = q.shape
        if k % BLOCK:
            raise ValueError(f"NativeQ4: in_features {k} is not a multiple of {BLOCK}")
        scale, zero = scale.float(), zero.float() - 8 * scale.float()  # w = q * scale + zero
        if not (fp16_exact(scale) and fp16_exact(zero)):
            return None
        tiles, nb = -(-n // TILE), k // BLOCK
        q = torch.nn.functional.pad(q.to(torch.int64), (0, 0, 0, tiles * TILE - n))
        # [tile, lane, block, run, k, half]: weight 8 run + 2 k + half of the block, row 16 tile + lane,
        # sits in bits 4 k + 16 half of the lane's 32-bit word of the run
        q = q.view(tiles, TILE, nb, 4, 4, 2)
        shift = (4 * torch.arange(4)[:, None] + 16 * torch.arange(2)[None, :])
        words = (q << shift).sum((4, 5)).to(torch.uint32)  # [tile, lane, block, run], < 2^32
        runs = words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(tiles, nb, 4 * 64)
        return NativeQ4(torch.cat((runs, per_lane(scale, tiles), per_lane(zero, tiles)), dim=2).contiguous(), n, k)

    def with_activations(self, activations: str) -> "NativeQ4":
        """The same records, the activations rounded as `activations` says."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"cpu_activations: {activations!r} is not one of {', '.join(ACTIVATIONS)}")
        return replace(self, activations=activations)

    @property
    def kernel_id(self) -> str:  # part of the crossover cache's key (int4_crossover_cache.py)
        return f"native-{build.isa()}" + ("" if self.activations == "int16" else f"-{self.activations}")

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return blocks.matmul("q4", x, self.records, self.out_features, ACTIVATIONS[self.activations])
