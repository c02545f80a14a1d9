"""Weight blocks requested into L2 before a product's PDL wait (sm_90's bulk prefetch).

At batch 1 a decoder layer alternates weight streams with latency-bound kernels (attention, the
head norms, the routing) during which HBM idles. A product launched early (PDL: the kernels
before it trigger at their start) already requests the tile it holds in registers before its
wait (gemv.py's whole rows, norm_gemv.py); its later tiles were requested only after. Here each
program also asks L2 for up to `count` later weight blocks before the wait,
`cp.async.bulk.prefetch.L2` (one instruction from one thread per contiguous block, no registers,
no result), so those bytes stream during the idle window and the later loads hit L2. The first
wave (PREFETCHERS_PER_SM programs an SM, each holding its own block) asks for the blocks past it,
round robin: program p for blocks p + P, p + 2P, ... (P prefetchers), as many as the budget allows.
o_proj is the product it is for: 16.8 MB on Qwen3-30B-A3B, ~5.7 µs at the H100's copy bandwidth,
behind ~8 µs of head norms and attention (docs/performance.md, run 77).

A hint: nothing waits for it, the results are the same bits with it on or off. The prefetched
bytes of one launch are capped (BUDGET_BYTES, well inside the 50 MB L2) so a large product (an LM
head of 0.6 GB, Llama's gate|up) does not evict what it is about to read. KETCH_L2_PREFETCH=1
turns it on (off until timed on a GPU); never in the interpreter (inline PTX).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ketch.kernels._common import interpreting, sm_count

ENABLED = os.environ.get("KETCH_L2_PREFETCH", "0") == "1"
BUDGET_BYTES = 16 << 20  # per launch
# programs per SM that prefetch: the first wave, resident while the kernels before run. One:
# a whole-row program at K 4096 holds 179 registers a thread (8 warps), one per SM fits
PREFETCHERS_PER_SM = 1
ALIGN = 16  # the bulk prefetch's address and size granularity


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Ask L2 for the nbytes (a multiple of 16) at ptr (16-byte aligned): thread 0 of the program
    issues one bulk prefetch. Returns a dummy (the asm has a side effect: not pure)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_blocks(W, first, step, count, n_rows, stride_wn, row_bytes, BLOCK_N: tl.constexpr):
    """Blocks first, first + step, ... (count of them, those past n_rows skipped) of BLOCK_N
    contiguous rows (stride_wn elements, row_bytes bytes each), into L2."""
    for j in range(count):
        row = (first + j * step) * BLOCK_N
        if row < n_rows:
            prefetch_l2(W + row.to(tl.int64) * stride_wn, tl.minimum(BLOCK_N, n_rows - row) * row_bytes)


def launch_plan(weight: torch.Tensor, block_n: int, n_blocks: int, programs: int, use_pdl: bool) -> tuple[int, int]:
    """(prefetchers, blocks each prefetches) for a launch of `programs` programs over n_blocks
    blocks of block_n rows, each program holding one block: the first PREFETCHERS_PER_SM an SM
    prefetch the blocks past theirs, within BUDGET_BYTES; (0, 0) where it is off: not enabled, no
    PDL wait to prefetch before, not a 16-bit GPU weight with contiguous, 16-byte aligned rows."""
    if not ENABLED or interpreting() or not use_pdl or not weight.is_cuda or weight.element_size() != 2:
        return 0, 0  # 16-bit weights only: an fp32 router is small, and its build spilled with the loop
    row_bytes = weight.shape[1] * weight.element_size()
    if weight.stride(1) != 1 or weight.stride(0) != weight.shape[1] or row_bytes % ALIGN or weight.data_ptr() % ALIGN:
        return 0, 0
    prefetchers = min(programs, PREFETCHERS_PER_SM * sm_count())
    return prefetchers, within_budget(block_n * row_bytes, n_blocks - prefetchers, prefetchers)


def within_budget(block_bytes: int, later: int, programs: int, budget: int = BUDGET_BYTES) -> int:
    """Blocks per program so that `programs` programs cover the `later` blocks, at most `budget`
    bytes in all."""
    if later <= 0 or programs <= 0:
        return 0
    return min(triton.cdiv(later, programs), budget // (programs * block_bytes))
