"""ketch's few-row fp32 product (ketch/native/f32_rows.c), the fp32 CPU model's dense projections
and logits for steps of up to 8 rows, built for each instruction set this CPU runs: within fp32's
rounding bound of the float64 product, each row bit for bit the same whatever batch it is in
(a verify row equals the plain decode row), and torch's product for everything it does not take."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ketch.layers import ops
from ketch.native import build, f32_rows

pytestmark = pytest.mark.skipif(build.library_path("f32_rows", "generic") is None, reason="no C compiler")
G = torch.Generator().manual_seed(0)


@pytest.fixture
def vector_isa(native_isa):
    if native_isa == "generic":
        pytest.skip("the generic build has no vector loop (the caller keeps torch's product)")
    assert f32_rows.library().ketch_f32_rows_isa() == build.ISA_CODE[native_isa]
    return native_isa


def test_generic_build_is_not_taken(monkeypatch):
    monkeypatch.setenv("KETCH_NATIVE_ISA", "generic")
    build.load.cache_clear()
    try:
        assert not f32_rows.available()
        assert ops.native_ops(torch.float32) is ops.TORCH_OPS
    finally:
        build.load.cache_clear()


# K not a multiple of either vector width (the masked last vector), N not of the 4-row tile
@pytest.mark.parametrize("n,k", [(3072, 576), (50, 100), (7, 1536), (1, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_within_fp32_rounding_of_the_float64_product(vector_isa, n, k, bias):
    w = torch.randn(n, k, generator=G)
    b = torch.randn(n, generator=G) if bias else None
    x = torch.randn(f32_rows.MAX_ROWS, k, generator=G)
    y = f32_rows.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # a sum of K products in 16 (8) lanes then a tree over the lanes: at most K/8 + 5 roundings
    eps = torch.finfo(torch.float32).eps
    bound = (k / 8 + 5 + 1) * eps * ((x.double().abs() @ w.double().abs().t()) + (0 if b is None else b.double().abs()))
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("k", [576, 100])
def test_a_row_is_the_same_in_any_batch(vector_isa, k):
    w = torch.randn(203, k, generator=G)
    b = torch.randn(203, generator=G)
    rows = torch.randn(f32_rows.MAX_ROWS, 2 * k, generator=G)[:, :k]  # rows with a stride of 2k
    assert rows.stride(0) == 2 * k
    alone = [f32_rows.linear(rows[i:i + 1], w, b) for i in range(len(rows))]
    for m in range(1, f32_rows.MAX_ROWS + 1):
        for start in range(0, len(rows) - m + 1, 3):
            together = f32_rows.linear(rows[start:start + m], w, b)
            for i in range(m):
                assert torch.equal(together[i:i + 1], alone[start + i]), (m, start, i)


def test_the_model_product_takes_few_fp32_rows_only(vector_isa):
    calls = []
    dense = f32_rows.make_linear(lambda *a: calls.append(a[0].shape) or F.linear(*a))
    w = torch.randn(64, 32, generator=G)
    x = torch.randn(f32_rows.MAX_ROWS + 1, 32, generator=G)
    for m in range(1, f32_rows.MAX_ROWS + 1):
        dense(x[:m], w, None)
    assert calls == []
    dense(x, w, None)  # a prefill's rows: the BLAS
    dense(x[:2].bfloat16(), w.bfloat16(), None)  # another dtype
    dense(x[:2], w.t().contiguous().t(), None)  # a weight that is a transposed view
    dense(x[:2].t().contiguous().t(), w, None)  # columns not contiguous
    assert len(calls) == 4
    assert torch.allclose(dense(x[:3], w, None), F.linear(x[:3], w), rtol=1e-5, atol=1e-5)
