"""A/B: F.linear (cuBLASLt GEMM, M=1) vs torch.mv (GEMV) for Llama-3.1-8B's projections, bf16, in a CUDA graph."""
import torch
import torch.nn.functional as F

shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
reps = 32
for name, (n, k) in shapes.items():
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]  # > L2: each rep streams from HBM
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    res = {}
    for tag, fn in (("linear", lambda w: F.linear(x, w)), ("mv", lambda w: torch.mv(w, x[0])[None])):
        for w in ws:
            fn(w)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(reps):
                fn(ws[i % 4])
        g.replay(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            g.replay()
        e.record(); torch.cuda.synchronize()
        us = s.elapsed_time(e) * 1e3 / (10 * reps)
        res[tag] = us
    d = (F.linear(x, ws[0]).float() - torch.mv(ws[0], x[0]).float()).abs().max().item()
    gb = n * k * 2 / 1e9
    print(f"{name:8s} [{n}x{k}] linear {res['linear']:7.1f} us ({gb / res['linear'] * 1e3:.2f} TB/s) | "
          f"mv {res['mv']:7.1f} us ({gb / res['mv'] * 1e3:.2f} TB/s) | max|diff| {d:.3g}")
