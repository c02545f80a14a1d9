"""What MLA decode (ketch/kernels/mla_decode.py) costs on CUDA, against the memory bandwidth.

DeepSeek-V2-Lite's attention (16 heads, latent rank 512 + rope 64, bf16), the engine's page
size (16; --page-size 64 for the other common one), pages shuffled as in a serving pool. For
batch 1 / 32 / 128 x context 1K / 4K, every sequence at the full context, it prints:

    us/call     one `mla_decode` (split-K stage 1 + merge), at the split count the backend picks
    cache GB/s  latent bytes read (batch x context x 576 x 2) / time: the number that matters,
                since decode is bound by reading the cache once per head block
    copy GB/s   a device-to-device copy of the same byte count in the same run, counted as
                bytes read + written (what the memory system moved)
    % copy      cache GB/s / copy GB/s
Each call reads a different set of pages (and each copy a different slice) out of >= 256 MB,
so nothing is served from the 50 MB L2; calls are timed in a CUDA graph of 20 (launch overhead
out; a graph holds one call per page set, at least 20). Before timing, one small batch is checked against `mla_decode_ref`. Under 2 minutes:

    PYTHONPATH=. python benchmarks/mla_decode.py [--page-size 64] [--block-n 32 --warps 4]
"""
from __future__ import annotations

import argparse

import torch

from ketch.kernels.decode_attention import decode_scratch
from ketch.kernels.mla_decode import mla_decode, mla_decode_ref, mla_num_splits

SWEEP_BYTES = 256 << 20  # each timed sweep touches at least this much (> L2)
CALLS = 20  # per graph, at least (one per page set when there are more)


def graph_us(fns: list, reps: int = 5) -> float:
    """Microseconds per call of fns[i % len(fns)], max(CALLS, len(fns)) calls captured in one CUDA graph."""
    calls = max(CALLS, len(fns))
    for fn in fns[:2]:
        fn()  # compile / warm
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns[:2]:
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * calls)


def case(batch: int, ctx: int, a: argparse.Namespace, sms: int) -> tuple[float, float, float, int]:
    """(us per decode call, cache GB/s, copy GB/s, splits)."""
    dev, dtype, width = torch.device("cuda"), torch.bfloat16, a.rank + a.rope
    pages_per_seq = -(-ctx // a.page_size)
    need = batch * pages_per_seq
    page_bytes = a.page_size * width * 2
    sets = max(1, min(256, -(-SWEEP_BYTES // (need * page_bytes))))  # one sweep of the sets > L2
    cache = torch.randn(sets * need, a.page_size, width, device=dev, dtype=dtype)
    perm = torch.randperm(sets * need, device=dev).to(torch.int32)
    tables = [perm[s * need : (s + 1) * need].view(batch, pages_per_seq) for s in range(sets)]
    q_lat = torch.randn(batch, a.heads, a.rank, device=dev, dtype=dtype) / 8
    q_pe = torch.randn(batch, a.heads, a.rope, device=dev, dtype=dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    splits = mla_num_splits(batch, a.heads, ctx, block_h=a.block_h, block_n=a.block_n, target_programs=2 * sms)
    scratch = decode_scratch(batch, a.heads, a.rank, splits, dev)
    out = torch.empty(batch, a.heads, a.rank, device=dev, dtype=dtype)
    scale = 192**-0.5

    def call(t: torch.Tensor):
        return lambda: mla_decode(q_lat, q_pe, cache, t, lens, scale, out=out, scratch=scratch, num_splits=splits,
                                  block_h=a.block_h, block_n=a.block_n, num_warps=a.warps)

    us = graph_us([call(t) for t in tables])
    n = batch * ctx * width
    src = cache.view(-1)
    slices = [src[i * n : (i + 1) * n] for i in range(max(1, min(sets, src.numel() // n)))]
    dst = torch.empty(n, device=dev, dtype=dtype)
    copy_us = graph_us([(lambda s=s: dst.copy_(s)) for s in slices])
    read = n * 2
    return us, read / us / 1e3, 2 * read / copy_us / 1e3, splits


def check(a: argparse.Namespace) -> float:
    """Max abs error vs the torch reference on a small ragged batch (lengths 1 .. 3000)."""
    dev, dtype, width = torch.device("cuda"), torch.bfloat16, a.rank + a.rope
    lens = [1, 37, a.page_size, 3000]
    pages = [-(-n // a.page_size) for n in lens]
    perm = torch.randperm(sum(pages), device=dev).to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=dev)
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[used : used + p]
        used += p
    cache = torch.randn(sum(pages), a.page_size, width, device=dev, dtype=dtype)
    q_lat = torch.randn(len(lens), a.heads, a.rank, device=dev, dtype=dtype) / 8
    q_pe = torch.randn(len(lens), a.heads, a.rope, device=dev, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    got = mla_decode(q_lat, q_pe, cache, table, seq_lens, 0.07, num_splits=4, block_h=a.block_h, block_n=a.block_n,
                     num_warps=a.warps)
    return (got.float() - mla_decode_ref(q_lat, q_pe, cache, table, seq_lens, 0.07).float()).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--block-h", type=int, default=16, help="heads per program (>= 16: tl.dot's minimum)")
    ap.add_argument("--block-n", type=int, default=32, help="tokens per step (the backend's default)")
    ap.add_argument("--warps", type=int, default=4)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/mla_decode.py: needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    err = check(a)
    print(f"{torch.cuda.get_device_name(0)}  heads {a.heads}  latent {a.rank}+{a.rope} bf16  page {a.page_size}  "
          f"block_h {a.block_h} block_n {a.block_n} warps {a.warps}  max |err| vs ref {err:.3g}")
    if err > 3e-2:
        raise SystemExit(f"mla_decode disagrees with mla_decode_ref (max abs error {err})")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'us/call':>9} {'cache GB/s':>10} {'copy GB/s':>9} {'% copy':>6}")
    for batch in (int(x) for x in a.batches.split(",")):
        for ctx in (int(x) for x in a.contexts.split(",")):
            us, gbs, copy, splits = case(batch, ctx, a, sms)
            print(f"{batch:5d} {ctx:7d} {splits:6d} {us:9.1f} {gbs:10.0f} {copy:9.0f} {100 * gbs / copy:5.0f}%")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
