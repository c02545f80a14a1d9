"""Weight blocks requested into L2 before a product's PDL wait (ketch/kernels/l2_prefetch.py,
KETCH_L2_PREFETCH): the sm_90 build issues the bulk prefetches before griddepcontrol.wait from
one thread; the per-launch budget; and on a GPU the same bits with it on as off (a hint only).
"""
import os
import re
import subprocess
import sys

import torch

if not torch.cuda.is_available():  # before triton or ketch.kernels is imported (as every kernel test)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from ketch.kernels.l2_prefetch import within_budget  # noqa: E402

NATIVE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_the_budget_caps_each_launch():
    # o_proj of Qwen3-30B-A3B at bs1: 1024 blocks of 16 KB; 132 first-wave programs (one an SM)
    # hold 132 of them: 7 each cover the other 892, 14.4 MB, within 16 MB
    assert within_budget(16384, 1024 - 132, 132, budget=16 << 20) == 7
    assert within_budget(16384, 10, 132) == 1
    assert within_budget(16384, 0, 132) == 0 and within_budget(16384, 5, 0) == 0
    # an LM head (37,984 blocks): never past the budget
    n = within_budget(16384, 37_984 - 132, 132, budget=16 << 20)
    assert n == (16 << 20) // (132 * 16384) and n * 132 * 16384 <= 16 << 20


@pytest.mark.skipif(sys.platform != "linux", reason="the triton wheel's ptxas")
def test_the_sm90_build_prefetches_before_the_wait_from_one_thread():
    """gemv's whole rows and norm_gemv with L2_PREFETCH: bulk L2 prefetches in the PTX before
    griddepcontrol.wait, predicated on thread 0; without it, none."""
    script = """
from ketch.kernels.compile_check import _compile
from ketch.kernels.gemv import _gemv_kernel
from ketch.kernels.norm_gemv import _norm_gemv_kernel
ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_xp", "n_blocks", "prefetchers", "prefetch", "row_bytes")
for fn, consts, warps in (
        (_gemv_kernel, dict(HAS_BIAS=False, UPCAST=False, PRECISION="tf32", BLOCK_M=1, BLOCK_N=2, BLOCK_K=4096), 8),
        (_norm_gemv_kernel, dict(PICKS=1, HAS_RESIDUAL=True, HAS_BIAS=False, BLOCK_N=4, BLOCK_K=2048, ROUTE=False,
                                 TOP_K=1, APPEND=0, K_PAD=1, RENORMALIZE=False, BLOCK_E=1, COUNT=False,
                                 COUNT_ROWS=False), 8)):
    for on in (True, False):
        sig = {n: "i32" if n in ints else "*bf16" for n in fn.arg_names}
        sig.update(eps="fp32", route_scale="fp32") if "eps" in sig else None
        ptx = _compile(fn, sig, {**consts, "L2_PREFETCH": on, "USE_PDL": True}, 90, warps, 1).asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        first = ptx.find("cp.async.bulk.prefetch.L2.global")
        print(fn.__name__, on, wait, first, "tid.x" in ptx[:wait])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^(\w+) (True|False) (-?\d+) (-?\d+) (True|False)$", proc.stdout, re.MULTILINE)
    assert len(rows) == 4, proc.stdout
    for name, on, wait, first, one_thread in rows:
        assert int(wait) > 0, name
        if on == "True":
            assert 0 < int(first) < int(wait) and one_thread == "True", (name, proc.stdout)
        else:
            assert int(first) == -1, (name, proc.stdout)


@pytest.mark.skipif(not NATIVE, reason="needs an sm_90 GPU (bulk prefetch, PDL)")
def test_products_give_the_same_bits_with_the_prefetch(monkeypatch):
    """A hint only: o_proj-, router- and LM-head-shaped products (gemv's whole rows), and the
    norm + product launch, are bit-equal with KETCH_L2_PREFETCH on and off."""
    from ketch.kernels import l2_prefetch
    from ketch.kernels.gemv import gemv
    from ketch.kernels.norm_gemv import norm_gemv
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((2048, 4096), (128, 2048), (40_000, 2048)):
        x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        res = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        nw = torch.rand(k, device="cuda", generator=g).bfloat16() + 0.5
        outs = []
        for on in (False, True):
            monkeypatch.setattr(l2_prefetch, "ENABLED", on)
            outs.append((gemv(x, w), *norm_gemv(x, res, nw, 1e-6, w)))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b), (n, k)
