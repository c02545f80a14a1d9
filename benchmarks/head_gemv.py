"""MLA decode's per-head products at one row (ketch/kernels/head_gemv.py) against torch's bmm
(the backend's path for larger steps, and before), DeepSeek-V2-Lite's shapes (16 heads, nope 128,
v 128, rank 512, bf16), on CUDA:

    q_lat = q_nope @ W_UK_h          [1, 16, 128] x [16, 128, 512]
    out   = o_lat @ W_UV_h^T         [1, 16, 512] x [16, 512, 128]   (bmm: + the copy into out)

Each call uses another layer's kv_b_proj weight out of 32 (128 MB: not from the 50 MB L2), timed
in a CUDA graph (benchmarks/mla_decode.py's timer). Prints µs per call and the weight GB/s for the
bmm and for each kernel configuration (block_k, block_n, warps); max error against the bmm first.

    PYTHONPATH=. python benchmarks/head_gemv.py
"""
from __future__ import annotations

import itertools

import torch

from benchmarks.mla_decode import graph_us
from ketch.kernels.head_gemv import head_gemv

HEADS, NOPE, V, RANK, LAYERS = 16, 128, 128, 512, 32


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    ws = [torch.randn(HEADS, NOPE + V, RANK, device=dev, dtype=dt) / 16 for _ in range(LAYERS)]
    q = torch.randn(1, HEADS, NOPE, device=dev, dtype=dt)
    o = torch.randn(1, HEADS, RANK, device=dev, dtype=dt)
    out = torch.empty(1, HEADS, V, device=dev, dtype=dt)
    uk_bytes, uv_bytes = HEADS * NOPE * RANK * 2, HEADS * V * RANK * 2
    w = ws[0]
    err_k = (head_gemv(q, w[:, :NOPE]).float() - torch.bmm(q.transpose(0, 1), w[:, :NOPE]).transpose(0, 1).float()).abs().max()
    err_v = (head_gemv(o, w[:, NOPE:].transpose(1, 2)).float()
             - torch.bmm(o.transpose(0, 1), w[:, NOPE:].transpose(1, 2)).transpose(0, 1).float()).abs().max()
    print(f"max |kernel - bmm|: W_UK {err_k:.3g}, W_UV {err_v:.3g}")

    def report(name: str, uk: list, uv: list) -> None:
        tk, tv = graph_us(uk), graph_us(uv)
        print(f"{name:28} W_UK {tk:6.2f} us ({uk_bytes / tk / 1e3:6.0f} GB/s)   W_UV {tv:6.2f} us ({uv_bytes / tv / 1e3:6.0f} GB/s)")

    def bmm_uv(w: torch.Tensor) -> None:
        out[:1] = torch.bmm(o.transpose(0, 1), w[:, NOPE:].transpose(1, 2)).transpose(0, 1)

    report("bmm (+ copy for W_UV)", [lambda w=w: torch.bmm(q.transpose(0, 1), w[:, :NOPE]).transpose(0, 1) for w in ws],
           [lambda w=w: bmm_uv(w) for w in ws])
    for bk, bn, warps in itertools.product((32, 64, 128, 256), (16, 32, 64), (2, 4, 8)):
        kw = dict(block_k=bk, block_n=bn, num_warps=warps)
        report(f"head_gemv k{bk} n{bn} w{warps}",
               [lambda w=w: head_gemv(q, w[:, :NOPE], **kw) for w in ws],
               [lambda w=w: head_gemv(o, w[:, NOPE:].transpose(1, 2), out=out, **kw) for w in ws])


if __name__ == "__main__":
    main()
