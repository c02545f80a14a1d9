"""bs1 decode on the CPU, one engine: blocks of 8 steps alternated between reading the lone
sequence's consecutive pages as a view (the default) and gathering them (index_select, as before),
order flipped each block; prints the median ms/step of each and their ratio.

    PYTHONPATH=. python benchmarks/cpu_decode_view_ab.py [--blocks 12] [--prompt-len 512] [--dtype auto]
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams

STEPS = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    e = Engine(EngineConfig(dtype=a.dtype, max_num_seqs=1, kv_cache_memory=256 << 20, num_threads=2))
    attn, init = e.runner.attn, e.runner.attn.init_metadata
    mode = {"view": True, "viewed": 0}

    def metadata(batch):
        meta = init(batch)
        if mode["view"]:
            mode["viewed"] += meta.decode_first_page is not None
            return meta
        return dataclasses.replace(meta, decode_first_page=None)

    attn.init_metadata = metadata
    rng = random.Random(0)
    e.add_request("r", [rng.randrange(3, 49152) for _ in range(a.prompt_len)],
                  SamplingParams(temperature=0.0, max_tokens=STEPS * 2 * a.blocks + 8, ignore_eos=True))
    for _ in range(4):
        e.step()
    times: dict[str, list[float]] = {"view": [], "gather": []}
    for b in range(a.blocks):
        for name in (["view", "gather"] if b % 2 == 0 else ["gather", "view"]):
            mode["view"] = name == "view"
            t0 = time.perf_counter()
            for _ in range(STEPS):
                e.step()
            times[name].append((time.perf_counter() - t0) / STEPS * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"dtype {a.dtype}, prompt {a.prompt_len}: bs1 ms/step (median of {a.blocks} blocks) view {med['view']:.2f}, "
          f"gather {med['gather']:.2f}; view / gather {med['view'] / med['gather']:.3f}; per block "
          + str([round(x / y, 3) for x, y in zip(times["view"], times["gather"])])
          + f"; view-mode steps that read a view: {mode['viewed']} of {a.blocks * STEPS}", flush=True)


if __name__ == "__main__":
    main()
