"""Token -> expert sorting with block padding, the input of the grouped MoE GEMM (fused_moe.py).

The T tokens' k picks are T * k rows, named by their flat index `t * k + slot` (< T * k). They
are grouped by expert (tokens in order inside an expert: a stable sort) and each expert's run is
padded to a multiple of BLOCK_M with the sentinel T * k, so that every BLOCK_M-row block of the
result belongs to one expert:

    sorted_token_ids  [max_padded] int32   row ids by expert, sentinel-padded; entries past
                                           num_tokens_post_padded are sentinels too
    expert_ids        [max_padded / BLOCK_M] int32   the expert of each block; -1 past the end
    num_tokens_post_padded [1] int32      rows in use (a multiple of BLOCK_M)

max_padded = T * k + min(E, T * k) * (BLOCK_M - 1) rounded up to a multiple of BLOCK_M: at
most min(E, T * k) experts have rows, each pads fewer than BLOCK_M. It depends on the shapes only, so the GEMM's grid does too (CUDA
graphs); blocks past num_tokens_post_padded exit at once on the device.

Two implementations, the same outputs bit for bit (tests/test_fused_moe_kernel.py):
  * `_moe_align_kernel` (Triton): ONE launch, one program (one CTA) that walks all T * k rows
    in chunks of CHUNK: pass 1 counts rows per expert (a one-hot [CHUNK, E] compare summed over
    the rows), then the padded exclusive scan in registers; the sentinel fill of
    sorted_token_ids, a CTA barrier, pass 2 scatters each row to its expert's running position
    (a scan of the one-hot over the chunk's rows gives the rank inside the expert, so rows stay
    in order), last the expert of each block (how many padded runs end at or before it). Work
    is rows * E compares per pass on one SM: a few µs at decode sizes, which is what it is for.
  * `moe_align_ref` (torch): about ten small device ops (scatter_add for the counts, cumsum, a
    stable argsort, a scatter, searchsorted), none of which reads back to the host. It costs
    ~10 launches a layer (~25 µs at bs1 on the H200, docs/performance.md), so `moe_align`
    takes it only where the kernel does not fit: T * k > ALIGN_KERNEL_MAX_ROWS (prefill-sized
    steps, where the single CTA's serial walk would cost more than the launches), CPU tensors
    outside the interpreter, and T = 0. The choice is by shape and device only (graph-safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ketch.kernels._common import interpreting, pdl_launch, pow2

# Up to this many (token, slot) rows the one-CTA kernel aligns; more: the torch ops. 4096 covers
# every decode graph size of a top-8 model (384 tokens x 8 = 3072); beyond it a step is a
# prefill, whose GEMMs dwarf ten launches, while the one CTA's time grows with rows * E.
ALIGN_KERNEL_MAX_ROWS = 4096
_HIT_ELEMENTS = 4096  # one-hot tile [CHUNK, BLOCK_E] per chunk: 32 int32 a thread at 4 warps
_FILL = 1024  # sentinel stores per round: 8 a thread


def max_padded_rows(rows: int, num_experts: int, block_m: int) -> int:
    """The bound above, rounded up to whole blocks (the GEMM reads sorted_token_ids by block)."""
    bound = rows + min(num_experts, rows) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch implementation (the kernel's reference and its fallback). No host sync."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # each expert's padded run ends here
    starts = ends - padded
    first = counts.cumsum(0) - counts  # where each expert's rows start in the unpadded sort
    order = flat.argsort(stable=True)  # row ids grouped by expert, in row order inside each
    expert_of = flat[order]
    dest = starts[expert_of] + torch.arange(rows, device=device) - first[expert_of]
    total = max_padded_rows(rows, num_experts, block_m)
    sorted_ids = torch.full((total,), rows, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, total, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)  # first expert whose run ends after
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


@triton.jit(do_not_specialize=["rows", "total"])
def _moe_align_kernel(TopkIds, SortedIds, ExpertIds, NumPostPad, rows, total,
                      NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                      CHUNK: tl.constexpr, FILL: tl.constexpr, USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    if USE_PDL:  # topk_ids is the routing kernel's output; nothing is stored before this
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()  # the GEMMs wait for this grid to finish anyway
    # pass 1: rows per expert
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, rows, CHUNK):
        offs = start + lanes
        e = tl.load(TopkIds + offs, mask=offs < rows, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # each expert's padded run ends here (lanes >= E: 0 rows)
    run = ends - padded  # where each expert's next row goes
    # sentinels everywhere, then (after the barrier: other threads' stores land on the same
    # entries) the rows over them
    for start in range(0, total, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(SortedIds + offs, tl.zeros([FILL], dtype=tl.int32) + rows, mask=offs < total)
    tl.debug_barrier()
    for start in range(0, rows, CHUNK):
        offs = start + lanes
        e = tl.load(TopkIds + offs, mask=offs < rows, other=-1).to(tl.int32)
        hit = (e[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit  # earlier rows of the same expert in this chunk
        dest = tl.sum(hit * (run[None, :] + before), axis=1)
        tl.store(SortedIds + dest, offs, mask=offs < rows)
        run += tl.sum(hit, axis=0)
    # block b's expert: the number of (real) experts whose padded run ends at or before b * BLOCK_M
    real = experts < NUM_EXPERTS
    for start in range(0, total // BLOCK_M, CHUNK):
        b = start + lanes
        done = (ends[None, :] <= b[:, None] * BLOCK_M) & real[None, :]
        eid = tl.sum(done.to(tl.int32), axis=1)
        tl.store(ExpertIds + b, tl.where(eid < NUM_EXPERTS, eid, -1), mask=b < total // BLOCK_M)
    tl.store(NumPostPad, tl.sum(padded, axis=0))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (any integer type, values in [0, num_experts)) -> (sorted_token_ids,
    expert_ids, num_tokens_post_padded) as described above. No host sync: the kernel for
    0 < T * k <= ALIGN_KERNEL_MAX_ROWS on CUDA (or in the interpreter), else the torch ops."""
    rows = topk_ids.numel()
    if not 0 < rows <= ALIGN_KERNEL_MAX_ROWS or not (topk_ids.is_cuda or interpreting()):
        return moe_align_ref(topk_ids, num_experts, block_m)
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    total = max_padded_rows(rows, num_experts, block_m)
    sorted_ids = torch.empty(total, dtype=torch.int32, device=device)
    expert_ids = torch.empty(total // block_m, dtype=torch.int32, device=device)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=device)
    block_e = pow2(num_experts)
    chunk = max(16, min(pow2(max(rows, total // block_m)), _HIT_ELEMENTS // block_e))
    _moe_align_kernel[(1,)](flat, sorted_ids, expert_ids, num_post_pad, rows, total, NUM_EXPERTS=num_experts,
                            BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, FILL=_FILL, num_warps=4, **pdl_launch(1))
    return sorted_ids, expert_ids, num_post_pad
