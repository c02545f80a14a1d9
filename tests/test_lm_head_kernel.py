"""The one-row logits kernel (torch.mv or the 1-row GEMM) is timed once at init on the CPU
(`VocabParallelEmbedding.pick_one_row_kernel`); either gives the same logits up to summation order."""
from __future__ import annotations

import torch

from ketch.layers.vocab_parallel import VocabParallelEmbedding


def test_pick_one_row_kernel_sets_a_choice_and_both_agree():
    torch.manual_seed(0)
    head = VocabParallelEmbedding(4096, 64)
    head.weight.data = torch.randn(4096, 64).bfloat16()
    picked = head.pick_one_row_kernel()
    assert isinstance(picked, bool) and head.one_row_mv is picked
    x = torch.randn(1, 64).bfloat16()
    head.one_row_mv = True
    mv = head.project(x)
    head.one_row_mv = False
    gemm = head.project(x)
    assert mv.dtype == gemm.dtype == torch.float32 and mv.shape == gemm.shape == (1, 4096)
    torch.testing.assert_close(mv, gemm, rtol=1e-2, atol=1e-2)


def test_fp32_rows_keep_the_reference_gemm():
    head = VocabParallelEmbedding(256, 16)
    head.weight.data = torch.randn(256, 16)
    head.one_row_mv = True  # ignored for fp32: parity with HF needs the GEMM
    x = torch.randn(1, 16)
    assert torch.equal(head.project(x), x @ head.weight.t())
