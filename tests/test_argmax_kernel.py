"""The greedy pick's kernel (ketch/kernels/argmax.py) against torch.argmax: ties to the lowest
index, NaN the largest (the first one), rows of -inf, every dtype, vocabularies off the block.

Without CUDA the kernels run in Triton's CPU interpreter (fp32, fp16); with CUDA compiled, bf16 too.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ketch.kernels import argmax  # noqa: E402
from ketch.kernels.argmax import argmax_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 5), (1, argmax.BLOCK * 3 + 17), (3, 2 * argmax.BLOCK), (2, 1000)])
def test_argmax_rows_is_torch_argmax(dtype, rows, vocab):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(DEVICE, dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_nan_and_minus_inf_rows():
    v = argmax.BLOCK * 2 + 100
    x = torch.randn(5, v, generator=torch.Generator().manual_seed(1))
    x[0, [7, argmax.BLOCK + 3, v - 1]] = 50.0  # a tie across chunks: the lowest index
    x[1, [argmax.BLOCK + 9, 2 * argmax.BLOCK + 4]] = float("nan")  # the first NaN wins
    x[1, 0] = float("inf")
    x[2] = float("-inf")  # nothing but -inf: index 0
    x[3, v - 1] = float("inf")  # the last entry, in the partial chunk
    x[4, :] = 0.0  # all equal: index 0
    x = x.to(DEVICE)
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got.tolist() == [7, argmax.BLOCK + 9, 0, v - 1, 0]


def test_strided_rows_and_bad_shapes():
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    assert torch.equal(argmax_rows(x[:, ::2]), x[:, ::2].argmax(dim=-1))
    assert argmax_rows(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match="argmax_rows"):
        argmax_rows(x[0])
    with pytest.raises(ValueError, match="argmax_rows"):
        argmax_rows(x[:, :0])
