"""Decode at batch B, one engine (CPU default: bf16 + the GGUF's 4-bit blocks, 2 threads): blocks of
8 steps alternated between the fixed 4-bit threshold of before (INT4_MAX_TOKENS = 8 tokens for
every layer) and the crossovers start-up measured per shape (ketch/layers/int4_crossover.py),
order flipped each block. Prints what start-up measured and the median ms/step of each.

    PYTHONPATH=. python benchmarks/int4_crossover_ab.py [--batches 8,16,32] [--blocks 8]
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 PYTHONPATH=. python benchmarks/int4_crossover_ab.py   # no AMX
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.layers.linear import INT4_MAX_TOKENS, Linear
from ketch.sampling.params import SamplingParams

STEPS = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,16,32")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    e = Engine(EngineConfig(max_num_seqs=max(batches), kv_cache_memory=1 << 30, num_threads=2))
    layers = [m for m in e.runner.model.modules() if isinstance(m, Linear) and m.int4 is not None]
    measured = {id(m): m.int4_max_tokens for m in layers}
    print(f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}; measured per shape:",
          sorted({(tuple(m.weight.shape), m.int4_max_tokens) for m in layers}), flush=True)
    modes = {"fixed 8": lambda m: INT4_MAX_TOKENS, "measured": lambda m: measured[id(m)]}
    rng = random.Random(0)
    for bs in batches:
        params = SamplingParams(temperature=0.0, max_tokens=STEPS * 2 * a.blocks + 16, ignore_eos=True)
        for i in range(bs):
            e.add_request(f"b{bs}-{i}", [rng.randrange(3, 49152) for _ in range(a.prompt_len)], params)
        while len(e.scheduler.running) < bs or any(r.num_pending != 1 for r in e.scheduler.running):
            e.step()  # prefill until every request decodes
        times: dict[str, list[float]] = {k: [] for k in modes}
        for b in range(a.blocks):
            for name in list(modes)[b % 2:] + list(modes)[: b % 2]:
                for m in layers:
                    m.int4_max_tokens = modes[name](m)
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    e.step()
                times[name].append((time.perf_counter() - t0) / STEPS * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"bs {bs}: ms/step (median of {a.blocks} blocks) " + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
              + f"; measured / fixed {med['measured'] / med['fixed 8']:.3f} (tok/s {1e3 * bs / med['fixed 8']:.1f} -> "
              f"{1e3 * bs / med['measured']:.1f}); per block "
              + str([round(x / y, 2) for x, y in zip(times["measured"], times["fixed 8"])]), flush=True)
        for i in range(bs):
            e.abort(f"b{bs}-{i}")
        while e.has_unfinished():
            e.step()


if __name__ == "__main__":
    main()
