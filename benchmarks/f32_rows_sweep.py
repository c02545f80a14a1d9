"""ketch's few-row fp32 product (ketch/native/f32_rows.c) against torch's F.linear (MKL's sgemm) by
row count, on SmolLM2-135M's shapes: 30 layers' worth of distinct weights per call set (so W comes
from memory, as in a decode step), best of 3 rounds.

    PYTHONPATH=. python benchmarks/f32_rows_sweep.py [--rows 1,2,3,4,5,6,8,12,16] [--threads N]
    (an emulated AVX2 machine: KETCH_NATIVE_ISA=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2)

Per shape and row count: ms for the set, the ratio, each product's largest error against float64,
and whether row 0 of the batch is bit for bit row 0 alone (the batch invariance the C product
promises; MKL's is shown for contrast)."""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from best_time import best_seconds
from ketch.native import build, f32_rows

SHAPES = [(3072, 576, 30), (576, 1536, 30), (960, 576, 30), (49152, 576, 1)]  # gate_up, down, qkv, head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not f32_rows.available():
        raise SystemExit("the few-row fp32 product does not build here (no compiler, or no AVX2)")
    print(f"isa {build.isa()}, {a.threads} threads, torch {torch.__version__}")
    g = torch.Generator().manual_seed(0)
    for n, k, layers in SHAPES:
        ws = [torch.randn(n, k, generator=g) for _ in range(layers)]
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            mkl = best_seconds(lambda: [F.linear(x, w) for w in ws]) * 1e3
            ours = best_seconds(lambda: [f32_rows.linear(x, w) for w in ws]) * 1e3
            exact = F.linear(x.double(), ws[0].double())
            err_mkl = (F.linear(x, ws[0]).double() - exact).abs().max().item()
            err_ours = (f32_rows.linear(x, ws[0]).double() - exact).abs().max().item()
            inv_ours = torch.equal(f32_rows.linear(x, ws[0])[:1], f32_rows.linear(x[:1], ws[0]))
            inv_mkl = torch.equal(F.linear(x, ws[0])[:1], F.linear(x[:1], ws[0]))
            print(f"{n}x{k} x{layers}  rows {m:2d}  F.linear {mkl:6.2f} ms  f32_rows {ours:6.2f} ms ({mkl / ours:4.2f}x)  "
                  f"max err {err_mkl:.1e} / {err_ours:.1e}  row 0 batch-invariant {inv_mkl} / {inv_ours}", flush=True)


if __name__ == "__main__":
    main()
