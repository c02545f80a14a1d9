"""ketch's C int8-block product (ketch/native/q8_matmul.c), the CPU's batch-1 LM head, built for
each instruction set this CPU runs: equal to its int16-activation arithmetic done in float64,
within the rounding bound of the exact product, and a Q8_0 matrix is held with its file's values."""
from __future__ import annotations

import pytest
import torch

from ketch.native import blocks, build
from ketch.native.q8 import NativeQ8

pytestmark = pytest.mark.skipif(build.library_path("q8_matmul", "generic") is None, reason="no C compiler")


def q8_0(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A matrix as GGUF's Q8_0 holds it: fp16 d per block of 32, q in -127..127 (each block's
    largest |q| is 127, as Q8_0's rounding makes it). Returns (w, q, d)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).half().float()
    q = torch.randint(-126, 127, (n, k // 32, 32), generator=g)
    q[..., 5] = 127 * (1 - 2 * torch.randint(0, 2, (n, k // 32), generator=g))
    w = (q.float() * d[..., None]).view(n, k)
    return w, q.view(n, k), d


def test_a_q8_0_matrix_keeps_its_values():
    w, q, d = q8_0(50, 96, seed=1)
    packed = NativeQ8.quantize(w)
    assert torch.equal(packed.dequantize(), w)


@pytest.mark.parametrize("n,k", [(4096, 576), (50, 64), (1000, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_is_the_int16_arithmetic(native_isa, n, k, dtype):
    w, _, _ = q8_0(n, k, seed=n)
    packed = NativeQ8.quantize(w)
    assert blocks.library("q8").ketch_q8_isa() == build.ISA_CODE[native_isa]
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[1] = 0
    y = packed.matmul(x)
    xf = x.float().view(6, -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    qx = torch.round(xf * torch.where(amax > 0, 32767 / amax.clamp_min(1e-30), 0.0)).double()
    want = (qx * (amax / 32767).double()).view(6, k) @ w.double().t()
    out_round = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-6
    assert ((y.double() - want).abs() <= out_round * want.abs() + 1e-5 * want.abs().max()).all()
    bound = (amax / 32767 / 2).double().expand(-1, -1, 32).reshape(6, k) @ w.double().abs().t()
    exact = x.double() @ w.double().t()
    assert ((y.double() - exact).abs() <= bound + out_round * want.abs() + 1e-5 * want.abs().max()).all()
    assert torch.equal(y[1], torch.zeros(n, dtype=dtype))
    for i in (0, 3):  # a row alone is the row in the batch
        assert torch.equal(packed.matmul(x[i:i + 1]), y[i:i + 1])
