"""bs1 decode, one engine: blocks of 8 steps rotated between the one-row logits kernels
(VocabParallelEmbedding.one_row_kernel: torch.mv, the 1-row GEMM, int8 rows), order rotated each
block; prints what init picked and the median ms/step of each.
PYTHONPATH=. python benchmarks/lm_head_one_row_ab.py [blocks]"""
import random
import statistics
import sys
import time

from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.layers.vocab_parallel import VocabParallelEmbedding
from ketch.sampling.params import SamplingParams

KERNELS = ("mv", "gemm", "int8")
blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 12
e = Engine(EngineConfig(max_num_seqs=8, kv_cache_memory=256 << 20, num_threads=2))
heads = [m for m in e.runner.model.modules() if isinstance(m, VocabParallelEmbedding)]
print("picked at init:", [h.one_row_kernel for h in heads])
for h in heads:
    if h.int8 is None:
        h.quantize_int8()
rng = random.Random(0)
e.add_request("r", [rng.randrange(49152) for _ in range(128)],
              SamplingParams(temperature=0.0, max_tokens=8 * 3 * blocks + 8, ignore_eos=True))
for _ in range(3):
    e.step()
res = {k: [] for k in KERNELS}
for b in range(blocks):
    for kernel in KERNELS[b % 3:] + KERNELS[: b % 3]:
        for h in heads:
            h.one_row_kernel = kernel
        t0 = time.perf_counter()
        for _ in range(8):
            e.step()
        res[kernel].append((time.perf_counter() - t0) / 8 * 1e3)
m = {k: statistics.median(v) for k, v in res.items()}
print("bs1 ms/step (median of blocks):", {k: round(v, 2) for k, v in m.items()})
print("int8 / gemm per block:", [round(a / b, 2) for a, b in zip(res["int8"], res["gemm"])])
print("int8 / mv per block:", [round(a / b, 2) for a, b in zip(res["int8"], res["mv"])])
