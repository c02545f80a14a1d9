"""ketch's torch decoding of Q4_0 / Q4_1 / Q8_0 blocks gives gguf's own float32 values bit for bit
(transformers loads GGUF files through gguf.quants.dequantize: the parity tests rest on it), on
every tensor of the bundled file and on random blocks of each type, subnormal and extreme scales
and every nibble included; other types are left to gguf."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from ketch.weights import default_model_path
from ketch.weights.gguf_dequant import dequantize_blocks
from ketch.weights.gguf_file import GGUFFile

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def reference(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, qtype))).reshape(shape)


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes for every block, then the fp16 scale (and min) fields overwritten with chosen
    values: random bytes would make NaN/inf scales, which gguf and torch both carry but compare unequal."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    extremes = [6e-8, -6e-8, 65504.0, -65504.0, 0.0, -0.0]  # subnormal, largest, signed zeros
    scales = np.concatenate([extremes, rng.normal(0, 0.05, raw.shape[:2]).ravel()])[: raw.shape[0] * raw.shape[1]]
    raw[..., 0:2] = scales.astype(np.float16).reshape(raw.shape[:2]).view(np.uint8).reshape(*raw.shape[:2], 2)
    if qtype == GGMLQuantizationType.Q4_1:
        mins = rng.normal(0, 0.1, raw.shape[:2]).astype(np.float16)
        raw[..., 2:4] = mins.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, cols // block * size)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_decode_to_ggufs_values(qtype):
    rows, cols = 37, 96
    raw = random_blocks(qtype, rows, cols, seed=int(qtype))
    got = dequantize_blocks(raw, qtype, (rows, cols))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got, reference(raw, qtype, (rows, cols)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantized_values_round_trip_through_both_decoders(qtype):
    """Blocks written by gguf's own quantizer (real scale/min layout), 3-D shape."""
    x = np.random.default_rng(1).normal(0, 1, (4, 6, 64)).astype(np.float32)
    raw = quantize(x, qtype)
    assert torch.equal(dequantize_blocks(raw, qtype, x.shape), reference(raw, qtype, x.shape))


def test_every_tensor_of_the_bundled_file():
    g = GGUFFile(default_model_path())
    decoded = 0
    for name, info in g.tensors.items():
        got = dequantize_blocks(g.data(name), info.ggml_type, info.shape)
        if got is None:
            assert info.ggml_type not in TYPES
            continue
        assert torch.equal(got, reference(g.data(name), info.ggml_type, info.shape)), name
        decoded += 1
    assert decoded >= 200  # the file's Q4_1 and Q8_0 tensors


def test_other_types_are_left_to_gguf():
    raw = np.zeros((2, 4), dtype=np.float32)
    assert dequantize_blocks(raw, GGMLQuantizationType.F32, (2, 4)) is None
    assert dequantize_blocks(np.zeros((1, 210), np.uint8), GGMLQuantizationType.Q6_K, (1, 256)) is None
