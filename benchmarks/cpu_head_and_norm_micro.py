"""CPU micro-timings behind docs/performance.md (issue 18, 2026-12-03): the batch-1 LM head's three
one-row kernels on a 49152 x 576 bf16 matrix (alternated, median of 40), and the bf16 RMSNorm
variants on one 576-wide row (2,000 calls, median of 5), all without the profiler, 2 threads.
PYTHONPATH=. python benchmarks/cpu_head_and_norm_micro.py"""
import statistics
import time

import torch
import torch.nn.functional as F

from ketch.layers.vocab_parallel import VocabParallelEmbedding

torch.set_num_threads(2)
head = VocabParallelEmbedding(49152, 576)
head.weight.data = (torch.randn(49152, 576) * 0.05).bfloat16()
head.quantize_int8()
x = torch.randn(1, 576).bfloat16()
res: dict[str, list[float]] = {k: [] for k in ("mv", "gemm", "int8")}
for _ in range(40):
    for k in res:
        t = time.perf_counter()
        head._one_row(x, k)
        res[k].append(time.perf_counter() - t)
print("LM head one row, ms:", {k: round(statistics.median(v) * 1e3, 2) for k, v in res.items()})

row, w, r, eps = (torch.randn(1, 576) * 1000).bfloat16(), torch.randn(576).bfloat16(), torch.randn(1, 576).bfloat16(), 1e-5


def norm(x):
    return F.rms_norm(x, (576,), None, eps) * w


def manual(x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def add_norm(x, r):
    s = x + r
    return norm(s), s


compiled = torch.compile(add_norm, dynamic=False, fullgraph=True)


def per_call_us(f, *a, n=2000):
    for _ in range(50):
        f(*a)
    t = time.perf_counter()
    for _ in range(n):
        f(*a)
    return (time.perf_counter() - t) / n * 1e6


for name, f, a in [("F.rms_norm * w", norm, (row,)), ("fp32-statistics formula", manual, (row,)),
                   ("add + norm", add_norm, (row, r)), ("add + norm compiled", compiled, (row, r))]:
    print(f"RMSNorm {name:24s} {statistics.median(per_call_us(f, *a) for _ in range(5)):6.1f} us/call")
print("formula bit-identical to F.rms_norm:", torch.equal(norm(row), manual(row)))
