"""What a kernel boundary costs in a PDL chain, and what a flag handoff would cost instead.

A bs1 decode step is a chain of ~9 dependent launches a layer (docs/performance.md, issue 19);
the small ones (routing, MLA prepare, attention, W_UV) move next to no bytes and each still
takes 2-8 µs. This measures the boundary itself: a chain of L launches of P programs, each
program reading the whole previous output (an all-to-all dependency, as a GEMV's input) and
writing one value, in one CUDA graph:

    plain   no PDL: each launch starts when the one before has finished
    pdl     PDL: every program triggers its dependents first, then griddepcontrol.wait
            (ketch's EARLY_TRIGGER form)
    flag    PDL launch, no griddepcontrol.wait: every program triggers first, spins on the
            previous launch's counter (an acquire load) until all of its P programs have
            written, and after its own store adds 1 to its counter (release): the helpers
            of ketch/kernels/handoff.py, await_flag and add_flag. The counters are zeroed by
            a memset at the graph's start.
    flags   as flag, with one word per producer program instead of one counter (no P atomics
            queued on one address): each program sets its word (release), a consumer reads
            all P words at once (acquire) until every one is set.

--stream MB adds a weight stream to every launch (distinct bytes per launch, so from HBM): a
program's first tile requested before the wait / spin, the rest after, as ketch's gemv does.
Prints µs per launch; every run checks the chain's result (all values = L) and, for flag and
flags, that each launch's counter (or words) ends at P.

    python scripts/handoff_bench.py [--launches 200] [--programs 1 16 132 264] [--stream 0 8]
"""
import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ketch.kernels.handoff import add_flag, await_flag  # noqa: E402

PLAIN, PDL, FLAG, FLAGS = 0, 1, 2, 3
MODES = {"plain": PLAIN, "pdl": PDL, "flag": FLAG, "flags": FLAGS}
CNT_STRIDE = 512  # ints between counters (flags: a launch's words): whole 128-byte lines each


@triton.jit
def _unset_words(Words, offs, mask):
    return tl.sum(tl.where(tl.atomic_add(Words + offs, 0, mask=mask, sem="acquire", scope="gpu") == 0, mask, 0), 0)


@triton.jit
def _spin_words(Words, P: tl.constexpr, BLOCK_P: tl.constexpr):
    offs = tl.arange(0, BLOCK_P)
    mask = offs < P
    unset = _unset_words(Words, offs, mask)
    while unset > 0:
        unset = _unset_words(Words, offs, mask)


@triton.jit
def _link(X, Y, CntIn, CntOut, W, target, w_per_prog,
          P: tl.constexpr, BLOCK_P: tl.constexpr, WB: tl.constexpr, STREAM: tl.constexpr,
          MODE: tl.constexpr):
    pid = tl.program_id(0)
    if MODE != 0:
        tl.extra.cuda.gdc_launch_dependents()
    offs_w = tl.arange(0, WB)
    w_base = W + pid.to(tl.int64) * w_per_prog
    wsum = tl.zeros([WB], tl.float32)
    if STREAM:  # a parameter: safe before the wait
        wsum += tl.load(w_base + offs_w).to(tl.float32)
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
    if MODE == 2:
        await_flag(CntIn, target)
    if MODE == 3:
        _spin_words(CntIn, P, BLOCK_P)
    offs = tl.arange(0, BLOCK_P)
    x = tl.load(X + offs, mask=offs < P, other=float("-inf"), cache_modifier=".cg")
    if STREAM:
        for k in range(WB, w_per_prog, WB):
            wsum += tl.load(w_base + k + offs_w).to(tl.float32)
    y = tl.max(x, 0) + 1.0 + tl.sum(wsum, 0) * 0.0
    tl.store(Y + pid, y)
    if MODE == 2:
        add_flag(CntOut)
    if MODE == 3:
        tl.debug_barrier()
        tl.atomic_xchg(CntOut + pid, 1, sem="release", scope="gpu")


def run(mode: str, programs: int, launches: int, stream_mb: float, replays: int) -> float:
    dev = torch.device("cuda")
    bufs = torch.zeros(launches + 1, programs, device=dev)
    cnt = torch.zeros((launches + 1) * CNT_STRIDE, dtype=torch.int32, device=dev)
    wb = 1024  # bf16 elements per weight tile: 2 KB a program a step
    w_per_prog = 0
    if stream_mb:
        w_per_prog = max(wb, int(stream_mb * 2**20 / 2 / programs) // wb * wb)
    w = torch.ones(launches * programs * max(w_per_prog, wb), dtype=torch.bfloat16, device=dev)
    m = MODES[mode]

    def chain() -> None:
        cnt.zero_()
        if m == FLAGS:
            cnt[:programs] = 1  # the chain's input is ready
        else:
            cnt[0] = programs
        for i in range(launches):
            _link[(programs,)](
                bufs[i], bufs[i + 1], cnt[i * CNT_STRIDE:], cnt[(i + 1) * CNT_STRIDE:],
                w[i * programs * max(w_per_prog, wb):], programs, w_per_prog,
                P=programs, BLOCK_P=triton.next_power_of_2(programs), WB=wb, STREAM=bool(stream_mb),
                MODE=m, num_warps=4, launch_pdl=m != PLAIN)

    chain()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    bufs[1:].zero_()
    graph.replay()
    torch.cuda.synchronize()
    if not torch.all(bufs[launches] == launches):
        raise AssertionError(f"{mode} P={programs}: chain result {bufs[launches][:4].tolist()}, expected {launches}")
    if m in (FLAG, FLAGS):
        ends = cnt.view(-1, CNT_STRIDE)[1:, 0] if m == FLAG else cnt.view(-1, CNT_STRIDE)[1:, :programs].sum(1)
        if not torch.all(ends == programs):
            raise AssertionError(f"flag P={programs}: counters end at {ends.unique().tolist()}, expected {programs}")
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--programs", type=int, nargs="+", default=[1, 16, 132, 264])  # <= CNT_STRIDE
    ap.add_argument("--stream", type=float, nargs="+", default=[0.0, 8.0], help="MB of weights per launch")
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()
    if not all(0 < p <= CNT_STRIDE for p in args.programs):
        ap.error(f"--programs: each between 1 and {CNT_STRIDE} (a launch's flag words), got {args.programs}")
    print(f"{torch.cuda.get_device_name()}: {args.launches} launches a chain, µs per launch (median of "
          f"{args.replays} graph replays)")
    for mb in args.stream:
        for p in args.programs:
            row = {name: run(name, p, args.launches, mb, args.replays) for name in MODES}
            cells = "  ".join(f"{k} {v:7.2f}" for k, v in row.items())
            print(f"stream {mb:4.1f} MB  programs {p:4d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
