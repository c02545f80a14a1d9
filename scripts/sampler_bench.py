"""The sampler's cost per decode step, alone: `sample_on_device(...).to_host()` on random logits.

    PYTHONPATH=<tree> python scripts/sampler_bench.py [--batch 32] [--vocab 49152] [--repeat 200]

Prints one line per case (median and p10/p90 ms per call): greedy, temperature sampling with and
without a seed, and temperature + top-p + top-k. The machine this runs on is shared and noisy, so
compare two trees by running this for each in turn, several times (scripts/cpu_before_after.sh's
ABBA idea): the medians of the runs are what to read, not one run.

Rows are built through whatever `SamplingRow` the tree has (an older tree took a torch.Generator
per seeded request, a newer one the seed itself), so one script measures both.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from ketch.sampling.params import SamplingParams
from ketch.sampling.sampler import SamplingBatch, SamplingRow, sample_on_device

CASES = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8, unseeded": {"temperature": 0.8},
    "temperature 0.8, seeded": {"temperature": 0.8, "seed": 0},
    "temperature 0.8 + top_p 0.9 + top_k 50, seeded": {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 0},
}


def make_rows(kw: dict, batch: int) -> list[SamplingRow]:
    fields = {f.name for f in dataclasses.fields(SamplingRow)}
    rows = []
    for i in range(batch):
        seed = None if kw.get("seed") is None else kw["seed"] + i
        params = SamplingParams(**{**kw, "seed": seed})
        if seed is None:
            rows.append(SamplingRow(params))
        elif "generator" in fields:  # the older API: one torch.Generator per seeded request
            from ketch.sampling.generators import make_generator

            rows.append(SamplingRow(params, generator=make_generator(seed, "cpu")))
        else:
            rows.append(SamplingRow(params, seed=seed, num_output=0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    logits = torch.randn(a.batch, a.vocab, generator=torch.Generator().manual_seed(0)) * 3
    for name, kw in CASES.items():
        rows = make_rows(kw, a.batch)
        times = []
        for _ in range(a.repeat + 5):
            t0 = time.perf_counter()
            batch = SamplingBatch.build(rows, a.vocab, logits.device)  # per step, as the engine does
            sample_on_device(logits, batch).to_host()
            times.append(time.perf_counter() - t0)
        times = sorted(times[5:])
        q = statistics.quantiles(times, n=10)
        print(f"{name:48s} median {1e3 * statistics.median(times):7.2f} ms  "
              f"p10 {1e3 * q[0]:7.2f}  p90 {1e3 * q[-1]:7.2f}  (batch {a.batch}, vocab {a.vocab})")


if __name__ == "__main__":
    main()
