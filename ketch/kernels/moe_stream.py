"""A one-token MoE step in one launch: the gate|up and the down tiles of every pick as one stream.

    fused_experts_stream(x [1, H], w13, w2, topk_weights [1, P], topk_ids [1, P][, w13_scale=,
                         w2_scale=, sum_picks=True]) -> [1, H] (or the weighted picks [1, P, H])

is fused_moe.fused_experts_triton at one token (its direct path: each pick a block of its own):
the same tiles (fused_moe.moe_tile), the same roundings, the same result up to the K steps'
order. Why: at batch 1 the direct path is two launches, and the down GEMM's programs start only
when the whole gate|up grid has retired; on the H200 its 25 MB (Qwen3-30B-A3B) then stream at
2.8 TB/s behind a ramp, after a gate|up launch whose tail idles the memory too (run 123,
docs/performance.md). Here one persistent grid runs both kinds of tile in one order:

    U0 .. U(LAG-1), then for each later pick j: D(j - LAG) U(j), then the last LAG D's

U(j) = pick j's gate|up tiles (cdiv(I, UP_BLOCK_N) of them: silu(gate) * up -> inter[j]), D(j)
= its down tiles (cdiv(H, DOWN_BLOCK_N): inter[j] @ w2[expert]^T times the routing weight ->
out[j]). Program p takes units p, p + G, p + 2G, ... in that order, so down tiles of a pick run
while later picks' gate|up tiles still stream, and no grid boundary sits between the two GEMMs.

The dependency is a counter per pick (one 128-byte line): a U tile adds 1 after its stores (CTA
barrier, one release add); a D tile spins (acquire loads) until its pick's counter holds the
U tile count, then reads inter[j]. LAG picks between a pick's U tiles and its D tiles make the
spin a formality in steady state. The D tiles of a pick also count themselves past the wait on
a second counter; the last one zeroes both, so every launch finds them zero (the next launch
starts after this grid has completed: PDL's wait, or stream order).

Deadlock freedom: a D tile waits only for units earlier in the order; every program runs its
units in order and never waits on a later one; all G programs are resident at once (G = the
SMs times the programs that fit on one, from the compiled kernel's registers and shared memory),
so by induction on the order every unit completes. The interpreter runs programs one after
another: G = 1 there, which walks the order itself.

Counters: a buffer per device of MAX_PICKS line pairs, made at the first call (the
engine's eager warm-up, before any capture) and kept for the process; graph replays reuse it.
Off by default (KETCH_MOE_STREAM=1, or ENABLED = True) until an H200 A/B measures it faster.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ketch.kernels._common import dot_precision, interpreting, pdl_launch, sm_count
from ketch.kernels.fused_moe import FP8_BLOCK, moe_tile

ENABLED = os.environ.get("KETCH_MOE_STREAM", "0") == "1"
MAX_PICKS = 64  # counter line pairs a buffer holds: routed picks plus appended shared experts
LINE_INTS = 32  # int32 words per counter: one 128-byte line each, so that no two share one
UP_BLOCK_N = 32  # intermediate features per gate|up tile (2 x that many weight rows)
DOWN_BLOCK_N = 64  # output features per down tile
BLOCK_K = 128  # K step of both (divides 128: fp8 block scales)
NUM_WARPS = 4
NUM_STAGES = 3
LAG = 2  # picks between a pick's gate|up tiles and its down tiles in the order
PROGRAMS_PER_SM = 2  # at most; fewer where the compiled kernel does not fit that many
_INTERPRET_BLOCKS = (16, 16, 32)  # (UP_BLOCK_N, DOWN_BLOCK_N, BLOCK_K): the tests' small shapes
SHARED_MEMORY_PER_SM = 228 * 1024  # sm_90 (227 KB usable by one CTA, 1 KB reserved per CTA)
REGISTERS_PER_SM = 65536


@triton.jit
def unit_of(i, picks, n_up, n_down, lag):
    """(is_up, pick, block) of unit i of the order (module docstring)."""
    head = lag * n_up
    mid = n_up + n_down
    n_mid = picks - lag
    r = i - head
    in_head = i < head
    in_mid = (r >= 0) & (r < n_mid * mid)
    s = tl.maximum(r, 0) // mid
    o = tl.maximum(r, 0) - s * mid
    r2 = tl.maximum(r - n_mid * mid, 0)
    mid_up = o >= n_down
    is_up = in_head | (in_mid & mid_up)
    pick = tl.where(in_head, i // n_up, tl.where(in_mid, tl.where(mid_up, lag + s, s), n_mid + r2 // n_down))
    block = tl.where(in_head, i % n_up, tl.where(in_mid, tl.where(mid_up, o - n_down, o), r2 % n_down))
    return is_up, pick, block


@triton.jit
def _await_count(Count, target, SPIN: tl.constexpr):
    """Spin until *Count >= target (acquire: inter's stores before the adds are visible after).
    Not in the interpreter, whose one program walks the order: there an order that put a down
    tile first would read inter unwritten (and fail the tests) rather than spin forever."""
    seen = tl.atomic_add(Count, 0, sem="acquire", scope="gpu")
    if SPIN:
        while seen < target:
            seen = tl.atomic_add(Count, 0, sem="acquire", scope="gpu")


@triton.jit(do_not_specialize=["picks"])
def _moe_stream_kernel(
    X, W13, W2, Inter, Out, Scale13, Scale2, Ids, TopkWeights, Counts,
    picks, I, H, n_up, n_down, lag,
    stride_w13e, stride_w13n, stride_w2e, stride_w2n, stride_ir, stride_or,
    stride_s13e, stride_s13n, stride_s13k, stride_s2e, stride_s2n, stride_s2k,
    FP8: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, UP_N: tl.constexpr,
    DOWN_N: tl.constexpr, BLOCK_K: tl.constexpr, LINE: tl.constexpr, SPIN: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    n_units = picks * (n_up + n_down)
    last = pid + ((n_units - 1 - pid) // grid) * grid  # this program's last unit
    valid = tl.arange(0, 16) == 0  # one row in a 16-row dot tile
    if USE_PDL:  # x, the ids and the weights are this step's
        tl.extra.cuda.gdc_wait()
    for i in range(pid, n_units, grid):
        if USE_PDL and i == last:  # every program is resident: the norm after may launch
            tl.extra.cuda.gdc_launch_dependents()
        is_up, pick, block = unit_of(i, picks, n_up, n_down, lag)
        expert = tl.load(Ids + pick).to(tl.int64)
        rows = tl.full([16], pick, tl.int64)
        count = Counts + pick * (2 * LINE)
        if is_up:  # x (stride 0: every row of the tile is the token) against gate | up rows
            moe_tile(X, W13, Inter, Scale13, TopkWeights, expert, rows, valid, block, I, H,
                     0, stride_w13e, stride_w13n, stride_ir, stride_s13e, stride_s13n, stride_s13k,
                     1, True, False, FP8, UPCAST, PRECISION, 16, UP_N, BLOCK_K, False)
            tl.debug_barrier()  # every thread's inter stores, then one release add
            tl.atomic_add(count, 1, sem="release", scope="gpu")
        else:
            _await_count(count, n_up, SPIN)
            if tl.atomic_add(count + LINE, 1, sem="relaxed", scope="gpu") == n_down - 1:
                tl.store(count, 0)  # the pick's last down tile past the wait: both back to 0
                tl.store(count + LINE, 0)
            moe_tile(Inter, W2, Out, Scale2, TopkWeights, expert, rows, valid, block, H, I,
                     stride_ir, stride_w2e, stride_w2n, stride_or, stride_s2e, stride_s2n, stride_s2k,
                     1, False, True, FP8, UPCAST, PRECISION, 16, DOWN_N, BLOCK_K, False)


_counts: dict[int, torch.Tensor] = {}
_programs: dict[tuple, int] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The device's counter buffer, zeroed at first use (outside a capture). One a device: the
    launches that use it run one after another (one compute stream; a graph's capture stream
    replays on it too)."""
    key = device.index if device.index is not None else -1
    buf = _counts.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe_stream: the counters were first asked for during graph capture; "
                               "run one eager step first")
        buf = _counts[key] = torch.zeros(MAX_PICKS * 2 * LINE_INTS, dtype=torch.int32, device=device)
    return buf


def resident_programs(compiled: object, num_warps: int) -> int:
    """Programs of one compiled kernel that fit on one SM at once (registers, shared memory, warps)."""
    compiled._init_handles()  # loads the binary: n_regs is known from here
    regs = -(-max(1, compiled.n_regs) * 32 // 256) * 256 * num_warps  # allocated per warp, 256 at a time
    shared = compiled.metadata.shared + 1024  # each CTA's reserved kilobyte
    return max(0, min(REGISTERS_PER_SM // regs, SHARED_MEMORY_PER_SM // shared, 64 // num_warps, 32))


def fits(x: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether the stream takes this step: one token, at most MAX_PICKS picks, on the GPU (or the
    interpreter), switched on."""
    return (ENABLED and x.shape[0] == 1 and topk_ids.shape[-1] <= MAX_PICKS
            and (x.is_cuda or interpreting()))


def fused_experts_stream(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                         w2_scale: torch.Tensor | None = None, sum_picks: bool = True) -> torch.Tensor:
    """As fused_experts_triton at one token (whose checks the caller has made): [1, H], or with
    sum_picks False the weighted picks [1, P, H] (LayerOps.pick_rows). No host sync; the grid
    depends on the shapes only (CUDA graphs)."""
    from ketch.kernels.moe_combine import moe_sum

    if x.shape[0] != 1 or topk_ids.shape[-1] > MAX_PICKS:
        raise ValueError(f"fused_experts_stream: one token and at most {MAX_PICKS} picks, got ids {tuple(topk_ids.shape)}")
    picks = topk_ids.shape[-1]
    _, two_i, hidden = w13.shape
    inter = two_i // 2
    fp8 = w13_scale is not None
    up_n, down_n, block_k = _INTERPRET_BLOCKS if interpreting() else (UP_BLOCK_N, DOWN_BLOCK_N, BLOCK_K)
    if fp8 and FP8_BLOCK % block_k:
        raise ValueError(f"fused_experts_stream: fp8 K steps must divide {FP8_BLOCK}, got {block_k}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13, w2 = (w if w.stride(-1) == 1 else w.contiguous() for w in (w13, w2))
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    inter_act = x.new_empty(picks, inter)
    out = x.new_empty(picks, hidden)
    n_up, n_down = triton.cdiv(inter, up_n), triton.cdiv(hidden, down_n)
    args = (x, w13, w2, inter_act, out, w13_scale if fp8 else w13, w2_scale if fp8 else w2, ids, weights,
            counters(x.device), picks, inter, hidden, n_up, n_down, min(LAG, picks),
            w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), inter_act.stride(0), out.stride(0),
            *(w13_scale.stride() if fp8 else (0, 0, 0)), *(w2_scale.stride() if fp8 else (0, 0, 0)))
    consts = dict(FP8=fp8, UPCAST=interpreting() or x.dtype == torch.float32, PRECISION=dot_precision(x.dtype),
                  UP_N=up_n, DOWN_N=down_n, BLOCK_K=block_k, LINE=LINE_INTS, SPIN=not interpreting(), num_warps=NUM_WARPS,
                  num_stages=1 if interpreting() else NUM_STAGES, **pdl_launch())
    grid = min(picks * (n_up + n_down), _grid_cap(args, consts))
    _moe_stream_kernel[(grid,)](*args, **consts)
    if not sum_picks:
        return out.view(1, picks, hidden)
    return moe_sum(out.view(1, picks, hidden))


def _grid_cap(args: tuple, consts: dict) -> int:
    """1 in the interpreter; else SMs x the programs that fit on one (at most PROGRAMS_PER_SM),
    from the compiled kernel (compiled once per configuration, before the first launch)."""
    if interpreting():
        return 1
    key = (args[1].dtype, args[0].dtype, PROGRAMS_PER_SM, tuple(sorted((k, str(v)) for k, v in consts.items())))
    cap = _programs.get(key)
    if cap is None:
        compiled = _moe_stream_kernel.warmup(*args, grid=(1,), **consts)
        per_sm = min(PROGRAMS_PER_SM, resident_programs(compiled, NUM_WARPS))
        if per_sm < 1:
            raise RuntimeError(f"moe_stream: the compiled kernel does not fit on one SM ({compiled.n_regs} registers, "
                               f"{compiled.metadata.shared} bytes of shared memory)")
        cap = _programs[key] = per_sm * sm_count()
    return cap
