"""ketch's block products (ketch/native/q4_matmul.c, q8_matmul.c) reading their weights from
memory, not from cache: enough distinct matrices per round (>= 130 MB) that no level of cache
holds them, as in a decode step whose model (or whose fp32 target beside a draft) does not fit in
the last-level cache. Best of 5 rounds, GB/s of packed records read.

    PYTHONPATH=. python benchmarks/block_products_from_memory.py [--threads 2,1]
    (an emulated AVX2 machine: KETCH_NATIVE_ISA=avx2)
"""
from __future__ import annotations

import argparse

import torch

from best_time import best_seconds
from ketch.native import build
from ketch.native.q4 import NativeQ4
from ketch.native.q8 import NativeQ8


def q4_set(n: int, k: int, count: int, g: torch.Generator) -> list[NativeQ4]:
    out = []
    for _ in range(count):
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
        out.append(NativeQ4.pack(q, scale, torch.zeros_like(scale)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="2,1")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"isa {build.isa()}, torch {torch.__version__}")
    sets = {"q4 3072x576 x120": q4_set(3072, 576, 120, g), "q4 24576x576 x15": q4_set(24576, 576, 15, g),
            "q8 49152x576 x4 (the LM head)": [NativeQ8.quantize(torch.randn(49152, 576, generator=g)) for _ in range(4)]}
    for threads in map(int, a.threads.split(",")):
        torch.set_num_threads(threads)
        for name, ws in sets.items():
            nbytes = sum(w.records.numel() for w in ws)
            for rows in (1, 4):
                x = torch.randn(rows, ws[0].in_features, generator=g).bfloat16()
                s = best_seconds(lambda: [w.matmul(x) for w in ws], calls=5, rounds=5, warmup=2)
                print(f"{name:30s} rows {rows} threads {threads}: {nbytes / s / 1e9:5.1f} GB/s, "
                      f"{s / len(ws) * 1e6:7.1f} us a call", flush=True)


if __name__ == "__main__":
    main()
