"""Same-process A/B of CPU decode steps: eager vs EngineConfig.cpu_compile (issue 18).

    PYTHONPATH=. python benchmarks/cpu_compile_ab.py BATCH THREADS BLOCKS

Two engines on the bundled GGUF; BATCH random 128-token prompts each; blocks of 8 decode steps
alternate between them (order flipped every block); prints ms/step per block, the ratio of
medians and whether the greedy outputs match."""
import sys, random, time, statistics, torch
from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams
bs, nt, blocks = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
steps_per_block = 8
out_len = 2 + blocks * steps_per_block + 2
engines = {}
for name, cc in (("eager", False), ("compiled", True)):
    t0 = time.perf_counter()
    engines[name] = Engine(EngineConfig(max_num_seqs=max(bs, 8), max_num_batched_tokens=max(2048, bs * 128),
                                        kv_cache_memory=256 << 20, num_threads=nt, cpu_compile=cc))
    print(name, "init s", round(time.perf_counter() - t0, 1), flush=True)
rng = random.Random(0)
prompts = [[rng.randrange(49152) for _ in range(128)] for _ in range(bs)]
params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
toks = {k: {} for k in engines}
def step(name):
    for o in engines[name].step():
        toks[name].setdefault(o.request_id, []).extend(o.new_token_ids)
for name, e in engines.items():
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, params)
    t0 = time.perf_counter()
    step(name); step(name)  # prefill + first decode step (compiles the bucket)
    print(name, "prefill+first decode s", round(time.perf_counter() - t0, 1), flush=True)
times = {k: [] for k in engines}
for b in range(blocks):
    for name in (engines if b % 2 == 0 else list(engines)[::-1]):
        t0 = time.perf_counter()
        for _ in range(steps_per_block):
            step(name)
        times[name].append((time.perf_counter() - t0) / steps_per_block * 1e3)
for name, e in engines.items():
    while e.has_unfinished():
        step(name)
med = {k: statistics.median(v) for k, v in times.items()}
print(f"bs{bs} threads{nt}", {k: [round(x, 1) for x in v] for k, v in times.items()})
ratios = [c / e for c, e in zip(times["compiled"], times["eager"])]
print(f"bs{bs} median ms/step eager {med['eager']:.2f} compiled {med['compiled']:.2f} "
      f"ratio-of-medians {med['compiled']/med['eager']:.3f} median per-block ratio {statistics.median(ratios):.3f}")
same = sum(toks["eager"][r] == toks["compiled"][r] for r in toks["eager"])
print(f"greedy outputs identical: {same}/{bs}")
