"""Fused MoE Triton kernel (ketch/kernels/fused_moe.py) vs the torch reference
(ketch.layers.moe.fused_experts_ref), same run, same inputs. CUDA only.

For each model shape and batch size: checks the kernel against the reference (max abs error),
then times both with triton.testing.do_bench (L2 flushed between runs), the kernel also in a
CUDA graph (the decode path: launches are most of the cost at batch 1), and the alignment and
the softmax top-k routing alone, kernel and torch version ("(torch)" columns). Prints µs, TFLOP/s (6 * T * k * H * I useful FLOPs: gate|up and down) and the weight
bandwidth (every picked expert's w13 + w2 read once).

    python benchmarks/fused_moe.py                       # both shapes, batches 1 64 512, bf16
    python benchmarks/fused_moe.py --fp8                 # also fp8 weights, 128x128 block scales
    python benchmarks/fused_moe.py --shapes qwen3 --batches 1 8 --dtype fp16
    python benchmarks/fused_moe.py --sweep               # a small block-size sweep per shape and
                                                         # batch (CUDA graphs), printed as TUNED entries
    python benchmarks/fused_moe.py --decode --shapes qwen3 dsv2lite-shared --batches 1 2 4
                                                         # decode sizes: the grouped path vs
                                                         # moe_decode.py's (per layer, LAYERS expert
                                                         # sets a call) and a sweep of its blocks

Block sizes come from ketch.kernels.fused_moe.pick_config (TUNED, then the heuristic); the
config used is printed per row, for filling TUNED after a sweep.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # name: (experts, top_k, hidden, moe intermediate, shared experts folded in)
    "qwen3": ("Qwen3-30B-A3B", 128, 8, 2048, 768, 0),
    "dsv2lite": ("DeepSeek-V2-Lite", 64, 6, 2048, 1408, 0),
    # as the model runs it on CUDA: its 2 shared experts as slots 64, 65 that every token picks
    "dsv2lite-shared": ("V2-Lite+shared", 64, 6, 2048, 1408, 2),
}


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> float8_e4m3fn and fp32 absmax scales [E, N/block, K/block] (N, K multiples of block)."""
    e, n, k = w.shape
    blocks = w.float().view(e, n // block, block, k // block, block)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, n, k)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.repeat_interleave(block, 1).repeat_interleave(block, 2)).to(dtype)


def describe(cfg) -> str:  # noqa: ANN001  (a fused_moe.MoEConfig)
    parts = [f"BM{cfg.block_m}"]
    for name, g in (("up", cfg.up), ("down", cfg.down)):
        parts.append(f"{name} BN{g.block_n} BK{g.block_k} w{g.num_warps} s{g.num_stages}")
    return " | ".join(parts)


SWEEP_UP = ((32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3))  # (BN, BK, warps, stages)
SWEEP_DOWN = ((64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3))
# decode-sized steps (--sweep-decode): one BLOCK_M (16: an expert sees a row or two), narrower
# column blocks so that a few experts still fill the SMs, longer K steps
DECODE_UP = ((16, 128, 4, 4), (16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (32, 128, 2, 4), (64, 128, 4, 3),
             (16, 128, 2, 4), (16, 256, 2, 3))
DECODE_DOWN = ((16, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (32, 128, 2, 4), (16, 256, 2, 3),
               (64, 64, 4, 4))
LAYERS = 8  # --sweep-decode: expert sets per timed call (another layer's experts each, as decode reads them)
# --decode: moe_decode.DecodeConfig candidates, (block, K step, warps) of the gate|up kernel and of
# the down + combine kernel; each compiles for sm_90 without spills at bf16
DECODE_GATE_UP = ((4, 1024, 8), (2, 1024, 4), (4, 1024, 4), (8, 512, 4), (8, 1024, 8), (8, 128, 4), (16, 128, 4))
DECODE_DOWN_COMBINE = ((8, 512, 4), (4, 1024, 4), (8, 1024, 8), (16, 256, 4), (8, 128, 4), (32, 128, 4))


def sweep(fm, key: tuple, run, rep: int) -> tuple[float, object]:
    """For each BLOCK_M: the gate|up config with down at its first, then the down config with the
    best gate|up; (µs, best MoEConfig). Configs go in through fused_moe.TUNED (restored after)."""
    saved = fm.TUNED.get(key)
    best = (float("inf"), None)
    try:
        for bm in (16, 32, 64):
            up = min(((_time(fm, key, fm.MoEConfig(bm, fm.GemmConfig(*u), fm.GemmConfig(*SWEEP_DOWN[0])), run, rep), u)
                      for u in SWEEP_UP), key=lambda t: t[0])[1]
            for d in SWEEP_DOWN:
                cfg = fm.MoEConfig(bm, fm.GemmConfig(*up), fm.GemmConfig(*d))
                best = min(best, (_time(fm, key, cfg, run, rep), cfg), key=lambda t: t[0])
    finally:
        fm.TUNED.pop(key, None)
        if saved is not None:
            fm.TUNED[key] = saved
    return best


def sweep_decode(fm, key: tuple, run, rep: int) -> tuple[float, object]:
    """BLOCK_M 16; every gate|up config with down at the first, then every down config with the
    best gate|up; (µs per layer, best MoEConfig), run doing LAYERS layers a call."""
    saved = fm.TUNED.get(key)
    try:
        up = min(((_time(fm, key, fm.MoEConfig(16, fm.GemmConfig(*u), fm.GemmConfig(*DECODE_DOWN[0])), run, rep), u)
                  for u in DECODE_UP), key=lambda t: t[0])[1]
        best = min(((_time(fm, key, fm.MoEConfig(16, fm.GemmConfig(*up), fm.GemmConfig(*d)), run, rep),
                     fm.MoEConfig(16, fm.GemmConfig(*up), fm.GemmConfig(*d))) for d in DECODE_DOWN), key=lambda t: t[0])
    finally:
        fm.TUNED.pop(key, None)
        if saved is not None:
            fm.TUNED[key] = saved
    return best[0] / LAYERS, best[1]


def decode_paths(md, fm, sets, w13, w2, extra: dict, rep: int) -> tuple[float, float, float, object]:
    """µs per layer over the LAYERS expert sets of one call, in CUDA graphs: the grouped path
    (alignment, two GEMMs, combine), moe_decode.py's at its current config, and the best of a
    sweep of its blocks (every gate|up candidate with the first down one, then every down one
    with the best gate|up); the best DecodeConfig last."""
    import triton.testing

    def run(cfg=None, decode=True):
        def layers():
            for xs, ws, ids_j in sets:
                if decode:
                    md.fused_experts_decode(xs, w13, w2, ws, ids_j, cfg=cfg, **extra)
                else:
                    fm.fused_experts_triton(xs, w13, w2, ws, ids_j, **extra)
        return triton.testing.do_bench_cudagraph(layers, rep=rep) * 1e3 / LAYERS

    saved, md.DECODE_MAX_TOKENS = md.DECODE_MAX_TOKENS, 0
    try:
        grouped = run(decode=False)
    finally:
        md.DECODE_MAX_TOKENS = saved
    current = run(md.pick_decode_config(bool(extra)))
    fp8_ok = [u for u in DECODE_GATE_UP if not extra or md.FP8_BLOCK % u[1] == 0]
    downs = [d for d in DECODE_DOWN_COMBINE if not extra or md.FP8_BLOCK % d[1] == 0]
    up = min(fp8_ok, key=lambda u: run(md.DecodeConfig(*u, *downs[0])))
    best = min((md.DecodeConfig(*up, *d) for d in downs), key=run)
    return grouped, current, run(best), best


def _time(fm, key: tuple, cfg, run, rep: int) -> float:
    import triton.testing

    fm.TUNED[key] = ((1 << 62, cfg),)
    try:
        return triton.testing.do_bench_cudagraph(run, rep=rep) * 1e3
    except Exception as e:  # noqa: BLE001  (out of shared memory / registers: skip the config)
        print(f"  skipped {describe(cfg)}: {type(e).__name__}", flush=True)
        return float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["qwen3", "dsv2lite"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64, 512], help="tokens per step")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--fp8", action="store_true", help="also fp8 e4m3 weights with 128x128 block scales")
    ap.add_argument("--rep", type=int, default=50, help="do_bench ms per measurement")
    ap.add_argument("--sweep", action="store_true", help="block-size sweep instead of the comparison")
    ap.add_argument("--sweep-decode", action="store_true",
                    help="decode-sized sweep: BLOCK_M 16, narrow column blocks, each call over LAYERS expert sets "
                         "(none in L2 from the call before); prints the current pick's time beside the best")
    ap.add_argument("--decode", action="store_true",
                    help="decode sizes: the grouped path vs moe_decode.py's and a sweep of its blocks (µs per layer, "
                         "LAYERS expert sets a call)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fused_moe.py needs CUDA")

    import triton.testing

    import ketch.kernels.fused_moe as fm
    import ketch.kernels.moe_decode as md
    from ketch.kernels.fused_moe import FP8_BLOCK, fused_experts_triton, pick_config
    from ketch.kernels.moe_align import moe_align, moe_align_ref
    from ketch.kernels.moe_route import softmax_topk_triton
    from ketch.layers.moe import fused_experts_ref
    from ketch.layers.moe_routing import append_picks, softmax_topk

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  {a.dtype}")
    head = (f"{'model':17s} {'w':4s} {'T':>5s} {'ref µs':>9s} {'triton µs':>9s} {'graph µs':>9s} {'align µs':>8s} {'(torch)':>8s} "
            f"{'route µs':>8s} {'(torch)':>8s} {'speedup':>7s} {'ref TF/s':>8s} {'tri TF/s':>8s} {'tri GB/s':>8s} {'max err':>8s}  config")
    print(head)
    for key in a.shapes:
        name, routed, routed_k, h, inter, shared = SHAPES[key]
        e, k = routed + shared, routed_k + shared  # the fused kernel's experts and picks
        g = torch.Generator(device=dev).manual_seed(0)
        w13 = (torch.randn(e, 2 * inter, h, device=dev, generator=g) * h ** -0.5).to(dtype)
        w2 = (torch.randn(e, h, inter, device=dev, generator=g) * inter ** -0.5).to(dtype)
        variants = [("16", w13, w2, {}, w13, w2)]
        if a.fp8:
            q13, s13 = quantize_blocks(w13, FP8_BLOCK)
            q2, s2 = quantize_blocks(w2, FP8_BLOCK)
            variants.append(("fp8", q13, q2, {"w13_scale": s13, "w2_scale": s2},
                             dequantize_blocks(q13, s13, FP8_BLOCK, dtype), dequantize_blocks(q2, s2, FP8_BLOCK, dtype)))
        for tokens in a.batches:
            x = torch.randn(tokens, h, device=dev, generator=g).to(dtype)
            logits = torch.randn(tokens, routed, device=dev, generator=g).to(dtype)
            weights, ids = append_picks(*softmax_topk(logits, routed_k, True), routed, shared)
            t_route = triton.testing.do_bench(lambda: softmax_topk_triton(logits, routed_k, True, append=shared),
                                              rep=a.rep) * 1e3
            t_route_ref = triton.testing.do_bench(lambda: softmax_topk(logits, routed_k, True), rep=a.rep) * 1e3
            flops = 6.0 * tokens * k * h * inter
            hit = int(torch.unique(ids).numel())
            for kind, tw13, tw2, extra, rw13, rw2 in variants:
                wbytes = hit * 3 * h * inter * tw13.element_size() + (hit * 3 * h * inter // FP8_BLOCK ** 2 * 4 if extra else 0)

                def tri(tw13=tw13, tw2=tw2, extra=extra):
                    return fused_experts_triton(x, tw13, tw2, weights, ids, **extra)

                def ref(rw13=rw13, rw2=rw2):
                    return fused_experts_ref(x, rw13, rw2, weights, ids)

                # other routed experts per layer (the shared slots stay)
                sets = [(x, weights, torch.cat(((ids[:, :routed_k] + 7 * j) % routed, ids[:, routed_k:]), 1))
                        for j in range(LAYERS)]
                if a.decode:
                    grouped, current, t, cfg = decode_paths(md, fm, sets, tw13, tw2, extra, rep=min(a.rep, 20))
                    got = md.fused_experts_decode(x, tw13, tw2, weights, ids, **extra)
                    err = (got.float() - ref().float()).abs().max()
                    print(f"{name:17s} {kind:4s} {tokens:5d} grouped {grouped:6.1f} µs/layer  decode {current:6.1f} "
                          f"({md.pick_decode_config(bool(extra))})  best {t:6.1f} ({cfg})  "
                          f"{wbytes / current / 1e3:6.0f} GB/s  max err {err.item():.1e}", flush=True)
                    continue
                if a.sweep_decode:

                    def layers(tw13=tw13, tw2=tw2, extra=extra, sets=sets):
                        for xs, ws, ids_j in sets:
                            fused_experts_triton(xs, tw13, tw2, ws, ids_j, **extra)

                    now = triton.testing.do_bench_cudagraph(layers, rep=min(a.rep, 20)) * 1e3 / LAYERS
                    t, cfg = sweep_decode(fm, (e, h, inter, k, kind), layers, rep=min(a.rep, 20))
                    print(f"{name:17s} {kind:4s} {tokens:5d} current {now:7.1f} µs/layer ({describe(pick_config(tokens, e, h, inter, k, kind))})"
                          f"  best {t:7.1f} µs/layer  ({tokens}, {cfg!r})", flush=True)
                    continue
                if a.sweep:
                    t, cfg = sweep(fm, (e, h, inter, k, kind), tri, rep=min(a.rep, 20))
                    print(f"{name:17s} {kind:4s} {tokens:5d} best {t:8.1f} µs  TUNED[{(e, h, inter, k, kind)}]: "
                          f"({tokens}, {cfg!r})", flush=True)
                    continue
                err = (tri().float() - ref().float()).abs().max().item()
                t_ref = triton.testing.do_bench(ref, rep=a.rep) * 1e3
                t_tri = triton.testing.do_bench(tri, rep=a.rep) * 1e3
                cfg = pick_config(tokens, e, h, inter, k, kind)
                t_graph = triton.testing.do_bench_cudagraph(tri, rep=a.rep) * 1e3
                t_align = triton.testing.do_bench(lambda: moe_align(ids, e, cfg.block_m), rep=a.rep) * 1e3
                t_align_ref = triton.testing.do_bench(lambda: moe_align_ref(ids, e, cfg.block_m), rep=a.rep) * 1e3
                print(f"{name:17s} {kind:4s} {tokens:5d} {t_ref:9.1f} {t_tri:9.1f} {t_graph:9.1f} {t_align:8.1f} "
                      f"{t_align_ref:8.1f} {t_route:8.1f} {t_route_ref:8.1f} "
                      f"{t_ref / t_tri:6.2f}x {flops / t_ref / 1e6:8.2f} {flops / t_tri / 1e6:8.2f} "
                      f"{wbytes / t_tri / 1e3:8.0f} {err:8.1e}  {describe(cfg)}", flush=True)


if __name__ == "__main__":
    main()
