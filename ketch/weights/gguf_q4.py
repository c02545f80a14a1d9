"""4-bit GGUF blocks (Q4_0, Q4_1) kept as 4-bit (ketch.layers.q4.Q4Weight), for the CPU small-batch
matmul kernel.

A block holds 32 weights of one row: an fp16 scale d (Q4_1 also an fp16 min m) and 16 bytes
of nibbles (low nibbles are elements 0..15, high nibbles 16..31). Both map exactly onto the
(q - 8) * scale + zero form that torch's int4 kernel takes:
    Q4_0: w = d * (q - 8)      -> scale d, zero 0
    Q4_1: w = d * q + m        -> scale d, zero m + 8 d
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ketch.layers.q4 import BLOCK, Q4Weight  # the matrix type: a layer's, this file only fills it
from ketch.weights.gguf_loader import GGUFWeights, hf_name, unpermute_rotary


def decode_q4(raw: np.ndarray, ggml_type: GGMLQuantizationType, rows: int, cols: int) -> Q4Weight:
    """raw: uint8 [rows, cols / 32 * block_bytes] as stored in the file."""
    has_min = ggml_type == GGMLQuantizationType.Q4_1
    block_bytes = 20 if has_min else 18
    blocks = raw.reshape(rows, cols // BLOCK, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else None
    nibbles = blocks[..., block_bytes - 16 :]
    q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
    zero = m + 8 * d if has_min else np.zeros_like(d)
    return Q4Weight(torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(zero))


def iter_q4_weights(path: str) -> Iterator[tuple[str, Q4Weight]]:
    """(hf_name, Q4Weight) for every 2-D Q4_0/Q4_1 tensor, q/k rows un-permuted like the dense loader."""
    source = GGUFWeights(path, torch.float32)
    for name in source.names:
        info = source.gguf.tensors[name]
        if info.ggml_type not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1) or len(info.shape) != 2:
            continue
        w = decode_q4(source.gguf.data(name), info.ggml_type, *info.shape)
        heads = source.rotary_heads(name)
        if heads:
            w = Q4Weight(*(unpermute_rotary(t, heads) for t in (w.q, w.scale, w.zero)))
        yield hf_name(name), w
