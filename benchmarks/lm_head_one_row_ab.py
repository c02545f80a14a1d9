"""bs1 decode, one engine: blocks of 8 steps alternated between torch.mv and the 1-row GEMM for the
logits (VocabParallelEmbedding.one_row_mv); PYTHONPATH=. python benchmarks/lm_head_one_row_ab.py"""
import sys, random, time, statistics, torch
from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams
from ketch.layers.vocab_parallel import VocabParallelEmbedding
e = Engine(EngineConfig(max_num_seqs=8, kv_cache_memory=256 << 20, num_threads=2))
heads = [m for m in e.runner.model.modules() if isinstance(m, VocabParallelEmbedding)]
print("picked one_row_mv =", [h.one_row_mv for h in heads])
rng = random.Random(0)
e.add_request("r", [rng.randrange(49152) for _ in range(128)], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
for _ in range(3): e.step()
toks = {True: [], False: []}
res = {True: [], False: []}
for b in range(16):
    for mv in ((True, False) if b % 2 == 0 else (False, True)):
        for h in heads: h.one_row_mv = mv
        t0 = time.perf_counter()
        for _ in range(8): e.step()
        res[mv].append((time.perf_counter() - t0) / 8 * 1e3)
m = {k: statistics.median(v) for k, v in res.items()}
print(f"bs1 ms/step mv {m[True]:.2f} gemm {m[False]:.2f} ratio gemm/mv {m[False]/m[True]:.3f}; per-block ratios",
      [round(a / b, 2) for a, b in zip(res[False], res[True])])
