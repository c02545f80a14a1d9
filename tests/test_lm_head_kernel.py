"""The one-row logits kernel (torch.mv, the 1-row GEMM, or int8 rows with a scale per vocab row) is
timed once at init on the CPU (`VocabParallelEmbedding.pick_one_row_kernel`). mv and the GEMM give
the same logits up to summation order; int8 within what its rounding allows, derived per row."""
from __future__ import annotations

import pytest
import torch

from ketch.layers.vocab_parallel import VocabParallelEmbedding, choose_one_row_kernel
from ketch.native.q8 import NativeQ8


def bf16_head(vocab: int = 4096, dim: int = 64) -> VocabParallelEmbedding:
    g = torch.Generator().manual_seed(0)
    head = VocabParallelEmbedding(vocab, dim)
    # rows of different scales: one scale per row must follow each
    head.weight.data = (torch.randn(vocab, dim, generator=g) * torch.rand(vocab, 1, generator=g)).bfloat16()
    return head


def test_pick_one_row_kernel_sets_a_choice_and_keeps_int8_only_when_picked():
    head = bf16_head()
    picked = head.pick_one_row_kernel()
    assert picked in ("mv", "gemm", "int8") and head.one_row_kernel == picked
    assert (head.int8 is not None) == (picked == "int8")
    exact_only = bf16_head()
    assert exact_only.pick_one_row_kernel(kernels=("mv", "gemm")) in ("mv", "gemm") and exact_only.int8 is None


def test_every_head_of_a_shape_takes_the_first_ones_pick():
    """Two engines of one process (a test comparing them, an A/B) must not differ by a timing."""
    picks = set()
    for _ in range(4):
        head = bf16_head()
        picks.add(head.pick_one_row_kernel())
        assert (head.int8 is not None) == (head.one_row_kernel == "int8")
    assert len(picks) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_rows_round_to_half_a_step_of_their_own_scale(dtype):
    head = bf16_head()
    w = head.weight.float()
    w[7] = 0  # a zero row (TP pads the last rank's share with them)
    w[9] *= 1e-4  # a row whose fp16 scale would be subnormal: its sign must survive
    head.weight.data = w.to(dtype)
    q, scales = head._int8_rows(chunk_rows=1000)  # torch's rows (chunks that do not divide the rows)
    assert q.dtype == torch.int8 and q.shape == head.weight.shape and scales.shape == (4096,) and scales.dtype == dtype
    w = head.weight.float()
    assert (q[7] == 0).all()  # and row 9's signs: a wrapped q would break the bound below
    big = w.abs().amax(dim=1) / 127 >= torch.finfo(dtype).tiny  # rows whose scale is not the floor
    assert (q.abs().amax(dim=1)[big] >= 126).all()  # they use the whole int8 range
    assert ((q.float() * scales.float()[:, None] - w).abs() <= scales.float()[:, None] * 0.5 * (1 + 1e-6)).all()


def test_int8_is_picked_only_by_a_margin():
    assert choose_one_row_kernel({"mv": 2.0, "gemm": 1.0, "int8": 0.79}) == "int8"
    assert choose_one_row_kernel({"mv": 2.0, "gemm": 1.0, "int8": 0.81}) == "gemm"  # a near tie keeps bf16
    assert choose_one_row_kernel({"mv": 1.0, "gemm": 2.0, "int8": 0.9}) == "mv"
    assert choose_one_row_kernel({"mv": 1.0, "gemm": 2.0}) == "mv"
    assert choose_one_row_kernel({"int8": 1.0}) == "int8"


@pytest.mark.parametrize("seed", range(3))
def test_the_three_kernels_agree(seed):
    head = bf16_head()
    head.quantize_int8()
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    logits = {}
    for kernel in ("mv", "gemm", "int8"):
        head.one_row_kernel = kernel
        logits[kernel] = head.project(x)
        assert logits[kernel].dtype == torch.float32 and logits[kernel].shape == (1, 4096)
    torch.testing.assert_close(logits["mv"], logits["gemm"], rtol=1e-2, atol=1e-2)
    exact = x.float() @ head.weight.float().t()
    if isinstance(head.int8, NativeQ8):
        # blocks of 32: each weight off by what the blocks hold, each activation by half its
        # block's int16 step; then the bf16 output's rounding
        held, xf = head.int8.dequantize(), x.float()
        step = (xf.view(-1, 32).abs().amax(-1, keepdim=True) / 32767 / 2).expand(-1, 32).reshape(1, -1)
        quantized = xf.abs() @ (held - head.weight.float()).abs().t() + step @ held.abs().t()
        assert (held - head.weight.float()).abs().max() > 0  # int8 values, not the bf16 ones
    else:
        # int8 rows: each weight is off by at most half its row's step, so a row's logit is off by
        # at most that times sum |x|, plus the bf16 output's rounding
        _, scales = head.int8
        quantized = scales.float() * 0.5 * x.float().abs().sum()
    bound = quantized + (exact.abs() + quantized) * 2**-8  # the int8 result is rounded to bf16
    assert ((logits["int8"] - exact).abs() <= bound).all()
    assert (logits["int8"] != logits["gemm"]).any()  # it is a different kernel, not the GEMM again


def test_fp32_rows_keep_the_reference_gemm():
    head = VocabParallelEmbedding(256, 16)
    head.weight.data = torch.randn(256, 16)
    for kernel in ("mv", "int8"):  # ignored for fp32: parity with HF needs the GEMM
        head.one_row_kernel = kernel
        x = torch.randn(1, 16)
        assert torch.equal(head.project(x), x @ head.weight.t())


def test_several_rows_take_int8_blocks_row_by_row_up_to_the_picked_count():
    """int8 for steps of up to int8_max_rows rows: each row's logits are the one-row int8
    kernel's, whatever rows share its step; a larger step takes the plain product."""
    head = bf16_head()
    head.quantize_int8()
    if not isinstance(head.int8, NativeQ8):
        pytest.skip("ketch's Q8 kernel is not built here")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    head.one_row_kernel, head.int8_max_rows = "int8", 5
    rows = torch.cat([head.project(x[i : i + 1]) for i in range(5)])
    many = head.project(x)
    assert torch.equal(many, rows)
    head.int8_max_rows = 4  # one row more than int8 takes: the GEMM
    assert torch.equal(head.project(x), (x @ head.weight.t()).float())
    assert not torch.equal(head.project(x), many)
    assert torch.equal(head.project(x[:4]), rows[:4])


def test_the_int8_row_count_is_the_last_of_an_unbroken_run_of_wins():
    from ketch.layers.vocab_parallel import UNBOUNDED, int8_rows_crossover

    sizes = (2, 4, 8, 16)
    assert int8_rows_crossover(sizes, [True, True, False]) == 4  # timing stops at the first loss
    assert int8_rows_crossover(sizes, [False]) == 1  # lost at 2 rows: one row only (its own pick)
    assert int8_rows_crossover(sizes, [True, False, True, True]) == 2  # a later win does not count
    assert int8_rows_crossover(sizes, [True] * 4) == UNBOUNDED  # won every size: every step


def test_pick_many_rows_kernel_keeps_int8_only_when_used(monkeypatch):
    picks = set()
    for _ in range(3):  # every head of a shape takes the first one's pick
        head = bf16_head(vocab=4128)
        head.pick_one_row_kernel(kernels=("mv", "gemm"))
        picks.add(head.pick_many_rows_kernel(sizes=(2, 4, 8)))
        assert (head.int8 is not None) == (head.int8_max_rows > 1)
        assert head.int8 is None or isinstance(head.int8, NativeQ8)
    assert len(picks) == 1 and picks <= {1, 2, 4, 1 << 62}
    monkeypatch.setenv("KETCH_NATIVE_CPU", "0")  # no Q8 kernel: torch's int8 rows are one-row only
    from ketch.native import build

    build.load.cache_clear()
    try:
        head = bf16_head(vocab=4160)
        assert head.pick_many_rows_kernel(sizes=(2, 4, 8)) == 1
    finally:
        build.load.cache_clear()


def test_fp32_rows_keep_the_reference_gemm_for_many_rows():
    head = VocabParallelEmbedding(256, 32)
    head.weight.data = torch.randn(256, 32)
    head.int8_max_rows = 1 << 62  # ignored for fp32
    x = torch.randn(3, 32)
    assert torch.equal(head.project(x), x @ head.weight.t())
