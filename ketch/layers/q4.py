"""A matrix held as 4-bit blocks: the form `Linear.attach_int4` takes for torch's int4 CPU kernel.

Each row is cut into blocks of BLOCK weights; a block has one scale and one zero, and a weight is
    w = (q - 8) * scale + zero,   q in 0..15
which is the form torch's int4 kernel takes. The file formats that carry 4-bit blocks (GGUF
Q4_0 / Q4_1: ketch/weights/gguf_q4.py) decode into this type; it lives here, below them, so a
layer never imports a file format.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block (GGUF's Q4 block; torch's kernel takes the group size as an argument)


@dataclass(frozen=True)
class Q4Weight:
    q: torch.Tensor  # int32 [out, in], values 0..15
    scale: torch.Tensor  # float32 [out, in / 32]
    zero: torch.Tensor  # float32 [out, in / 32]

    def dequantize(self) -> torch.Tensor:
        expand = lambda t: t.repeat_interleave(BLOCK, dim=1)  # noqa: E731
        return (self.q.float() - 8) * expand(self.scale) + expand(self.zero)
