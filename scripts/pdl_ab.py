"""A/B: programmatic dependent launch on vs off for a bs1 decode step of Llama-3.1-8B's kernels
(ketch's Triton kernels only) in one CUDA graph. Per layer: add_rms_norm, gemv qkv, rotary in
place, store_kv, decode_attention over ~200 tokens, gemv o, add_rms_norm, gemv gate_up,
silu_and_mul, gemv down; distinct weights per layer (they stream from HBM, as in a real step).

    python scripts/pdl_ab.py             # PDL on (sm_90+)
    python scripts/pdl_ab.py --no-pdl    # KETCH_DISABLE_PDL=1, set before ketch is imported
    python scripts/pdl_ab.py --tiny      # tiny shapes; without CUDA one eager run in the interpreter

The 'output sha1' line must be the same with and without --no-pdl (same bits).
"""
import argparse
import hashlib
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--no-pdl", action="store_true")
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--layers", type=int, default=32)
ap.add_argument("--ctx", type=int, default=200)
ap.add_argument("--replays", type=int, default=20)
args = ap.parse_args()
if args.no_pdl:
    os.environ["KETCH_DISABLE_PDL"] = "1"

import torch

if not torch.cuda.is_available():
    if not args.tiny:
        sys.exit("pdl_ab.py: needs CUDA (or --tiny for a CPU smoke run in the interpreter)")
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ketch.kernels._common import use_pdl
from ketch.kernels.activation import silu_and_mul
from ketch.kernels.decode_attention import decode_attention, num_splits_for
from ketch.kernels.gemv import gemv, picked_config
from ketch.kernels.kv_store import store_kv
from ketch.kernels.rmsnorm import add_rms_norm
from ketch.kernels.rotary import rotary

cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's bf16 is wrong
if args.tiny:
    hid, heads, kvh, dim, inter, page, layers, ctx = 64, 4, 2, 16, 96, 4, min(args.layers, 2), min(args.ctx, 19)
else:
    hid, heads, kvh, dim, inter, page, layers, ctx = 4096, 32, 8, 128, 14336, 16, args.layers, args.ctx
eps = 1e-5
pages = -(-ctx // page)
splits = num_splits_for(1, kvh, ctx)
gen = torch.Generator(device=dev).manual_seed(0)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) * scale).to(dtype)


ws = [{"qkv": randn((heads + 2 * kvh) * dim, hid, scale=hid**-0.5), "o": randn(hid, heads * dim, scale=(heads * dim) ** -0.5),
       "gu": randn(2 * inter, hid, scale=hid**-0.5), "down": randn(hid, inter, scale=inter**-0.5),
       "n1": 1 + randn(hid, scale=0.1), "n2": 1 + randn(hid, scale=0.1),
       "kc": randn(pages, page, kvh, dim), "vc": randn(pages, page, kvh, dim)} for _ in range(layers)]
table = torch.arange(pages, device=dev, dtype=torch.int32).view(1, pages)
slots = torch.tensor([ctx - 1], device=dev, dtype=torch.int32)  # page p holds positions p*page.. (identity table)
lens = torch.tensor([ctx], device=dev, dtype=torch.int32)
ang = torch.rand(1, dim // 2, generator=gen, device=dev) * 6.28
cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
sin = torch.cat([-ang.sin(), ang.sin()], -1).to(dtype)
x0, res0 = randn(1, hid), randn(1, hid)


def step() -> tuple[torch.Tensor, torch.Tensor]:
    x, res = x0, res0
    for w in ws:
        h, res = add_rms_norm(x, res, w["n1"], eps)
        qkv = gemv(h, w["qkv"]).view(1, heads + 2 * kvh, dim)
        qk = qkv[:, : heads + kvh]
        rotary(qk, cos, sin, out=qk)
        store_kv(w["kc"], w["vc"], qkv[:, heads : heads + kvh], qkv[:, heads + kvh :], slots)
        attn = decode_attention(qkv[:, :heads], w["kc"], w["vc"], table, lens, dim**-0.5, num_splits=splits)
        x = gemv(attn.reshape(1, heads * dim), w["o"])
        h, res = add_rms_norm(x, res, w["n2"], eps)
        x = gemv(silu_and_mul(gemv(h, w["gu"])), w["down"])
    return x, res


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().float().cpu().numpy().tobytes()).hexdigest()[:16]


print(f"PDL {'on' if use_pdl() else 'off'} | {layers} layers, hidden {hid}, ctx {ctx}, {splits} splits, {dtype}", flush=True)
out = step()  # compiles and autotunes (outside any capture)
if not cuda:
    assert all(bool(t.float().isfinite().all()) for t in out), "non-finite output"
    print(f"CPU interpreter smoke run ok | output sha1 {digest(out[0])} {digest(out[1])}")
    sys.exit(0)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out = step()
for _ in range(3):
    g.replay()
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(args.replays):
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) * 1e3)
times.sort()
med = times[len(times) // 2]
print(f"step median {med:8.1f} us (min {times[0]:.1f}) | {med / layers:6.1f} us per layer | "
      f"{11 * layers} kernels per step")
print("gemv configs: " + "; ".join(f"{n}: {picked_config(w.shape[0], w.shape[1], 1)}"
                                   for n, w in ws[0].items() if n in ("qkv", "o", "gu", "down")))
print(f"output sha1 {digest(out[0])} {digest(out[1])}")
