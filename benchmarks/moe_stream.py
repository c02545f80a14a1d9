"""The one-token MoE step: the two-launch direct path (fused_moe.py) vs the one-launch stream
(moe_stream.py), same run, same inputs, CUDA graphs. CUDA only.

Each timed call runs LAYERS MoE steps, each on a weight set of its own (as a decode step's
layers: no expert in L2 from the step before) and its own routing; µs per layer, and the
picked experts' bytes over that time. Every stream variant is checked against the direct
path first (bf16: within 2e-2). Variants set moe_stream's module constants:

    python benchmarks/moe_stream.py                                  # both shapes, the defaults
    python benchmarks/moe_stream.py --shapes qwen3 --sweep           # a sweep of the tiles, lag, grid
    python benchmarks/moe_stream.py --set UP_BLOCK_N=16 DOWN_BLOCK_N=32 --set LAG=1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # name: (experts, routed picks, hidden, moe intermediate, shared experts appended)
    "qwen3": (128, 8, 2048, 768, 0),
    "dsv2lite-shared": (66, 6, 2048, 1408, 2),
}
LAYERS = 8
SWEEP = [
    {},
    {"UP_BLOCK_N": 16, "DOWN_BLOCK_N": 32},
    {"UP_BLOCK_N": 16, "DOWN_BLOCK_N": 64},
    {"UP_BLOCK_N": 64, "DOWN_BLOCK_N": 64},
    {"UP_BLOCK_N": 32, "DOWN_BLOCK_N": 128, "NUM_WARPS": 8},
    {"BLOCK_K": 64},
    {"BLOCK_K": 256},
    {"LAG": 1},
    {"LAG": 4},
    {"PROGRAMS_PER_SM": 1},
    {"PROGRAMS_PER_SM": 3},
    {"NUM_STAGES": 1},
]


def parse_set(text: str) -> dict[str, int]:
    out = {}
    for item in text.split():
        name, _, value = item.partition("=")
        out[name] = int(value)
    return out


def layer_inputs(shape: tuple, seed: int) -> list[tuple]:
    experts, k, hidden, inter, shared = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(LAYERS):
        w13 = 0.02 * torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
        w2 = 0.02 * torch.randn(experts, hidden, inter, generator=g, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
        routed = torch.randperm(experts - shared, generator=g, device="cuda")[:k]
        ids = torch.cat([routed, torch.arange(experts - shared, experts, device="cuda")]).view(1, -1)
        weights = torch.cat([torch.rand(k, generator=g, device="cuda"), torch.ones(shared, device="cuda")]).view(1, -1)
        sets.append((x, w13, w2, weights, ids))
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="the SWEEP list of constant sets")
    ap.add_argument("--set", action="append", default=[], help="one variant: NAME=VALUE ... (moe_stream constants)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph ms per measurement")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe_stream.py needs CUDA")
    import triton.testing

    from ketch.kernels import fused_moe, moe_stream

    variants = SWEEP if a.sweep else ([parse_set(s) for s in a.set] or [{}])
    defaults = {name: getattr(moe_stream, name) for v in variants for name in v}
    print(f"{torch.cuda.get_device_name()}; stream defaults: UP_BLOCK_N {moe_stream.UP_BLOCK_N} DOWN_BLOCK_N "
          f"{moe_stream.DOWN_BLOCK_N} BLOCK_K {moe_stream.BLOCK_K} warps {moe_stream.NUM_WARPS} stages "
          f"{moe_stream.NUM_STAGES} LAG {moe_stream.LAG} PROGRAMS_PER_SM {moe_stream.PROGRAMS_PER_SM}", flush=True)
    for name in a.shapes:
        shape = SHAPES[name]
        experts, k, hidden, inter, shared = shape
        sets = layer_inputs(shape, seed=0)
        layer_bytes = (k + shared) * 3 * hidden * inter * 2

        def run(stream: bool) -> list[torch.Tensor]:
            moe_stream.ENABLED = stream
            return [fused_moe.fused_experts_triton(x, w13, w2, wt, ids, sum_picks=False) for x, w13, w2, wt, ids in sets]

        def timed(stream: bool) -> float:
            run(stream)  # compile and make the counters outside the capture
            return triton.testing.do_bench_cudagraph(lambda: run(stream), rep=a.rep) * 1e3 / LAYERS

        want = run(False)
        base = timed(False)
        print(f"{name:16s} direct (two launches)  {base:7.2f} µs/layer  {layer_bytes / base / 1e3:7.0f} GB/s", flush=True)
        for v in variants:
            for const, value in {**defaults, **v}.items():
                setattr(moe_stream, const, value)
            try:
                got = run(True)
                err = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
                t = timed(True)
                print(f"{name:16s} stream {v or 'defaults'}  {t:7.2f} µs/layer  {layer_bytes / t / 1e3:7.0f} GB/s  "
                      f"x{base / t:5.3f}  max err {err:.2e}{'  WRONG' if err > 2e-2 else ''}", flush=True)
            except Exception as e:  # noqa: BLE001  (a variant that does not fit: say so, go on)
                print(f"{name:16s} stream {v}  failed: {type(e).__name__}: {e}", flush=True)
        for const, value in defaults.items():
            setattr(moe_stream, const, value)
        moe_stream.ENABLED = False


if __name__ == "__main__":
    main()
