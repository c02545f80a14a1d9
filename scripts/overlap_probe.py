"""Probe: can memory-bound decode attention and compute-bound GEMMs share the GPU?

Offline throughput at 1,000 × 1,000 / 1,000 is bounded by the serial sum of decode attention
(reads every token's KV every step) and the GEMMs (compute-bound at hundreds of rows). This
times, per decoder layer of Llama-3.1-8B, in CUDA graphs of `--layers` repetitions:
    attention alone   (ketch's paged decode kernel, rows x context tokens of bf16 or fp8 KV)
    GEMMs alone       (qkv, o, gate_up, SiLU·mul, down at the same rows)
    both at once      (attention graph on one stream, GEMM graph on another, started together)
and prints how much of the shorter one the concurrent run hides. One micro-batch's attention
beside the other's GEMMs (two streams) is what would take offline throughput past the serial
bound; this says how much such a schedule could win on this GPU before building it.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ketch.kernels.decode_attention import decode_attention, decode_scratch, num_splits_for  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, DIM, PAGE = 4096, 14336, 32, 8, 128, 16
SWEEP = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3), (256, 8, 2)]  # block_n, warps, stages


def graph_of(fn, reps: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compile / autotune / cuBLAS handles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(reps):
            fn()
    return g


def timed(launches: list[tuple[torch.cuda.CUDAGraph, torch.cuda.Stream]], iters: int = 5) -> float:
    """ms for all graphs started together (each on its stream), mean of iters."""
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # warm
        for g, s in launches:
            g.replay()
    torch.cuda.synchronize()
    start.record(main)
    for _ in range(iters):
        go = torch.cuda.Event()
        go.record(main)
        dones = []
        for g, s in launches:
            s.wait_event(go)
            with torch.cuda.stream(s):
                g.replay()
            done = torch.cuda.Event()
            done.record(s)
            dones.append(done)
        for d in dones:
            main.wait_event(d)
    end.record(main)
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="192,384")
    ap.add_argument("--contexts", default="1000,1500,2000")
    ap.add_argument("--layers", type=int, default=8, help="layer repetitions per graph")
    ap.add_argument("--kv-dtypes", default="bfloat16,float8_e4m3fn")
    ap.add_argument("--sweep", action="store_true",
                    help="also time attention alone over block_n x splits at the largest rows / middle context")
    a = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    w_qkv = torch.randn(6144, HIDDEN, device=dev, dtype=bf) * 0.02
    w_o = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=bf) * 0.02
    w_gu = torch.randn(2 * INTER, HIDDEN, device=dev, dtype=bf) * 0.02
    w_d = torch.randn(HIDDEN, INTER, device=dev, dtype=bf) * 0.02
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    s_attn, s_gemm = torch.cuda.Stream(), torch.cuda.Stream()
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; per-layer times in ms (graphs of {a.layers} layers)")
    for kv_name in a.kv_dtypes.split(","):
        kv_dtype = getattr(torch, kv_name)
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, HIDDEN, device=dev, dtype=bf)

            def gemms():
                qkv = F.linear(x, w_qkv)
                h = F.linear(qkv[:, :HIDDEN], w_o)
                gu = F.linear(h, w_gu)
                act = F.silu(gu[:, :INTER]) * gu[:, INTER:]
                F.linear(act, w_d)

            flop = 2 * rows * (6144 * HIDDEN + HIDDEN * HIDDEN + 2 * INTER * HIDDEN + HIDDEN * INTER)
            g_gemm = graph_of(gemms, a.layers, s_gemm)
            t_gemm = timed([(g_gemm, s_gemm)]) / a.layers
            for ctx in (int(c) for c in a.contexts.split(",")):
                pages_per = -(-ctx // PAGE)
                pools = [(torch.randn(rows * pages_per, PAGE, KV_HEADS, DIM, device=dev, dtype=bf).to(kv_dtype),
                          torch.randn(rows * pages_per, PAGE, KV_HEADS, DIM, device=dev, dtype=bf).to(kv_dtype))
                         for _ in range(2)]  # two layers' pools, alternated: nothing stays in L2
                table = torch.randperm(rows * pages_per, device=dev, dtype=torch.int32).view(rows, pages_per)
                lens = torch.full((rows,), ctx, device=dev, dtype=torch.int32)
                q = torch.randn(rows, HEADS, DIM, device=dev, dtype=bf)
                out = torch.empty_like(q)
                splits = num_splits_for(rows, KV_HEADS, ctx, target_programs=2 * sms)
                scratch = decode_scratch(rows, HEADS, DIM, splits, dev)
                it = iter(range(10**9))

                def attn(splits=splits, scratch=scratch, block_n=64, warps=4, stages=2):
                    kc, vc = pools[next(it) % 2]
                    decode_attention(q, kc, vc, table, lens, DIM**-0.5, out=out, scratch=scratch, num_splits=splits,
                                     block_n=block_n, num_warps=warps, num_stages=stages)

                contexts = sorted(int(c) for c in a.contexts.split(","))
                if a.sweep and rows == max(int(r) for r in a.rows.split(",")) and ctx == contexts[len(contexts) // 2]:
                    for bn, warps, stages in SWEEP:
                        for sp in (1, 2):
                            sc = decode_scratch(rows, HEADS, DIM, sp, dev)
                            g = graph_of(lambda: attn(sp, sc, bn, warps, stages), a.layers, s_attn)
                            t = timed([(g, s_attn)]) / a.layers
                            kvb = 2 * rows * ctx * KV_HEADS * DIM * pools[0][0].element_size()
                            print(f"  sweep kv {kv_name} rows {rows} ctx {ctx} block_n {bn:3d} warps {warps} "
                                  f"stages {stages} splits {sp} (default {splits}): {t:.3f} ms, "
                                  f"{kvb / t / 1e9:.2f} TB/s", flush=True)
                            del g

                g_attn = graph_of(attn, a.layers, s_attn)
                t_attn = timed([(g_attn, s_attn)]) / a.layers
                t_both = timed([(g_attn, s_attn), (g_gemm, s_gemm)]) / a.layers
                kv_bytes = 2 * rows * ctx * KV_HEADS * DIM * pools[0][0].element_size()
                serial, floor = t_attn + t_gemm, max(t_attn, t_gemm)
                hidden = (serial - t_both) / min(t_attn, t_gemm)
                print(f"kv {kv_name:14s} rows {rows:4d} ctx {ctx:5d} | attention {t_attn:.3f} "
                      f"({kv_bytes / t_attn / 1e9:.2f} TB/s) | GEMMs {t_gemm:.3f} ({flop / t_gemm / 1e9:.0f} TFLOP/s) | "
                      f"serial {serial:.3f} | both at once {t_both:.3f} (max {floor:.3f}) | "
                      f"hides {hidden:.0%} of the shorter", flush=True)
                del pools, g_attn
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
