"""Dequantize the common GGUF block types in torch: the same float32 values as
`gguf.quants.dequantize` (the same fp32 products and sums, not fused), several times faster
(its numpy path walks row groups in Python: 1.35 s of the bundled model's ~2.5 s engine start).

    Q4_0: 32 weights a block: fp16 d, 16 bytes of nibbles        w = d * (q - 8)
    Q4_1: fp16 d, fp16 m, 16 bytes of nibbles                     w = d * q + m
    Q8_0: fp16 d, 32 int8                                         w = q * d
Nibbles: the low halves of the 16 bytes are elements 0..15, the high halves 16..31. Other types
return None: the caller uses gguf's own dequantize."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

BLOCK = 32
_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}


def dequantize_blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor | None:
    """raw: the tensor's bytes as stored ([..., cols / 32 * block bytes] uint8); float32 `shape`."""
    size = _BYTES.get(ggml_type)
    if size is None:
        return None
    blocks = torch.from_numpy(np.array(raw)).reshape(-1, size)  # a writable copy of the mapped bytes
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]
    if ggml_type == GGMLQuantizationType.Q8_0:
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(shape)
    nibbles = blocks[:, size - 16:]
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=1)
    if ggml_type == GGMLQuantizationType.Q4_0:
        return (d * (q.to(torch.int8) - 8).float()).reshape(shape)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q.float() + m).reshape(shape)
