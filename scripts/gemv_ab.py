"""A/B: F.linear (cuBLASLt) vs ketch's skinny GEMM (ketch.kernels.gemv) for Llama-3.1-8B's
projections at M = 1, 2, 4, 8, bf16, 32 calls per CUDA graph over weights larger than L2."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ketch.kernels.gemv import gemv, picked_config  # noqa: E402

shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
reps = 32


def time_us(fn, ws: list[torch.Tensor]) -> float:
    for w in ws:  # warm-up outside the graph: compiles and autotunes
        fn(w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(ws[i % len(ws)])
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / (10 * reps)


for name, (n, k) in shapes.items():
    nw = max(4, -(-2_000_000_000 // (n * k * 2)))  # >= 2 GB of weights: each call streams from HBM
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(nw)]
    gb = n * k * 2 / 1e9
    for m in (1, 2, 4, 8):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        lin = time_us(lambda w: F.linear(x, w), ws)
        gv = time_us(lambda w: gemv(x, w), ws)
        d = (F.linear(x, ws[0]).float() - gemv(x, ws[0]).float()).abs().max().item()
        print(f"{name:8s} [{n}x{k}] M={m} linear {lin:7.1f} us ({gb / lin * 1e3:.2f} TB/s) | "
              f"gemv {gv:7.1f} us ({gb / gv * 1e3:.2f} TB/s) | max|diff| {d:.3g} | {picked_config(n, k, m)}", flush=True)
    del ws
    torch.cuda.empty_cache()
