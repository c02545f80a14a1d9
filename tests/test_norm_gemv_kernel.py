"""A sublayer's pre-norm and first product in one launch at one decode row
(ketch/kernels/norm_gemv.py) against the two launches it replaces (rmsnorm.py's add_rms_norm /
rms_norm, then the product); the op set's dispatch (LayerOps.add_rms_norm_linear); its sm_90 build;
engines of each family on the Triton layer kernels keeping the torch path's tokens at batch 1.

Without CUDA the kernels run in Triton's CPU interpreter (fp32, fp16); with CUDA compiled, bf16 too.
"""
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from engine_cut import assert_same_tokens, batch_one_on_both_paths, cut_config  # noqa: E402
from ketch.kernels import norm_gemv as ng  # noqa: E402
from ketch.kernels.rmsnorm import add_rms_norm, rms_norm  # noqa: E402
from ketch.layers.ops import FirstProduct, triton_ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def inputs(k: int, n: int, dtype: torch.dtype, seed: int = 0, weight_dtype: torch.dtype | None = None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=g) * 3).to(DEVICE, dtype)
    residual = (torch.randn(1, k, generator=g) * 20).to(DEVICE, dtype)  # a large stream, as in real models
    norm_w = (torch.rand(k, generator=g) + 0.5).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, weight_dtype or dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype)
    return x, residual, norm_w, w, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(64, 96), (70, 13), (2048, 40)])  # K not a power of two; N off the blocks
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("ahead", [2, 1])
def test_the_norm_and_the_product_of_the_two_launches(dtype, k, n, with_residual, ahead, monkeypatch):
    """h and the new residual as add_rms_norm (rms_norm and x itself without a residual) gives
    them, bit for bit in the interpreter; y as the product of that h (+ bias); with two weight
    tiles requested ahead (the default) and with one (the earlier kernel, the A/B's base)."""
    monkeypatch.setattr(ng, "TILES_AHEAD", ahead)
    x, residual, norm_w, w, bias = inputs(k, n, dtype, seed=k + n)
    h, res, y = ng.norm_gemv(x, residual if with_residual else None, norm_w, 1e-6, w, bias)
    if with_residual:
        want_h, want_res = add_rms_norm(x, residual, norm_w, 1e-6)
    else:
        want_h, want_res = rms_norm(x, norm_w, 1e-6), x
    if DEVICE.type == "cpu":
        assert torch.equal(h, want_h) and torch.equal(res, want_res)
    else:  # compiled, the two kernels may sum the squares in other orders
        torch.testing.assert_close(h.float(), want_h.float(), atol=TOL[dtype], rtol=TOL[dtype])
        assert torch.equal(res, want_res)
    if not with_residual:
        assert res is x  # the first layer's residual is its input
    want_y = F.linear(want_h.float(), w.float(), bias.float())
    torch.testing.assert_close(y.float(), want_y, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    assert y.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("at_once", [True, False], ids=["one-load", "row-at-a-time"])
def test_a_moe_steps_picks_are_summed_as_the_combine_does(dtype, with_residual, at_once, monkeypatch):
    """x as a one-token MoE step's weighted picks [1, k, K] (LayerOps.pick_rows): h, the new
    residual and y as moe_sum's row through the plain kernel, bit for bit in the interpreter;
    and the op set's norms (with and without a first product) sum them too. Both ways of
    reading the picks: one [k, K] tile, or a row at a time (past MAX_PICK_TILE)."""
    from ketch.kernels.moe_combine import moe_sum
    if not at_once:
        monkeypatch.setattr(ng, "MAX_PICK_TILE", 0)
    k, n, top_k = 70, 13, 6
    _, residual, norm_w, w, bias = inputs(k, n, dtype, seed=21)
    picks = (torch.randn(1, top_k, k, generator=torch.Generator().manual_seed(22)) * 2).to(DEVICE, dtype)
    row = moe_sum(picks)
    res_in = residual if with_residual else None
    got = ng.norm_gemv(picks, res_in, norm_w, 1e-6, w, bias)
    want = ng.norm_gemv(row, res_in, norm_w, 1e-6, w, bias)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        if DEVICE.type == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])
    ops = triton_ops()
    if with_residual:
        for a, b in zip(ops.add_rms_norm(picks, residual, norm_w, 1e-6), add_rms_norm(row, residual, norm_w, 1e-6),
                        strict=True):
            assert torch.equal(a, b)
        for a, b in zip(ops.add_rms_norm_linear(torch.cat((picks, picks)), torch.cat((residual, residual)), norm_w,
                                                1e-6, FirstProduct(w, bias)),
                        ops.add_rms_norm_linear(torch.cat((row, row)), torch.cat((residual, residual)), norm_w,
                                                1e-6, FirstProduct(w, bias)), strict=True):
            assert torch.equal(a, b)  # two tokens' picks: the combine, then the two-op path


def test_an_fp32_router_weight_gives_fp32_logits():
    """DeepSeek's router: fp32 weight, bf16/fp16 rows, fp32 logits, the same as widening h."""
    x, residual, norm_w, w, _ = inputs(64, 8, torch.float16, seed=3, weight_dtype=torch.float32)
    h, _, y = ng.norm_gemv(x, residual, norm_w, 1e-6, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(h.float(), w), atol=1e-5, rtol=1e-5)


def test_what_it_does_not_take_is_refused(monkeypatch):
    x, residual, norm_w, w, _ = inputs(64, 8, torch.float32)
    assert ng.fits(x, w)
    monkeypatch.setattr(ng, "ENABLED", False)  # KETCH_NORM_GEMV=0: the A/B's two launches
    assert not ng.fits(x, w)
    monkeypatch.setattr(ng, "ENABLED", True)
    assert not ng.fits(torch.cat((x, x)), w)  # two rows: the two-op path
    assert not ng.fits(x, w.to(torch.float16))  # another dtype than x's or fp32
    assert not ng.fits(x, w.t())  # not row-major
    with pytest.raises(ValueError, match="do not fit"):
        ng.norm_gemv(torch.cat((x, x)), None, norm_w, 1e-6, w)


def test_the_op_takes_the_kernel_for_one_row_and_the_two_ops_otherwise(monkeypatch):
    """LayerOps.add_rms_norm_linear: one row -> norm_gemv; more rows -> add_rms_norm then the
    product; the results agree either way (the kernel is watched, not replaced)."""
    calls = []
    real = ng.norm_gemv

    def watched(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(ng, "norm_gemv", watched)
    op = triton_ops().add_rms_norm_linear
    x, residual, norm_w, w, bias = inputs(64, 24, torch.float32, seed=5)
    first = FirstProduct(w, bias)
    one = op(x, residual, norm_w, 1e-6, first)
    two = op(torch.cat((x, x)), torch.cat((residual, residual)), norm_w, 1e-6, first)
    assert calls == [1]
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a, b[:1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(sys.platform != "linux", reason="the triton wheel's ptxas")
def test_the_kernel_compiles_for_sm90_without_spills():
    """Hidden sizes 2048 (Qwen3-30B-A3B, DeepSeek-V2-Lite), 4096 (Llama-3.1-8B), 7168
    (DeepSeek-V3) at the wrapper's blocks, bf16 weights and an fp32 router weight, built as for
    the models (sizes multiples of 16): no spills; registers that let PROGRAMS_PER_SM programs
    share an SM (the two weight tiles requested ahead must not halve that); before the PDL wait
    the weight tiles and the norm weight only, nothing stored."""
    script = """
from ketch.kernels._common import pow2
from ketch.kernels.compile_check import _compile, _usage
from ketch.kernels.gemv import whole_row_warps
from ketch.kernels.norm_gemv import _TILE_BYTES, PROGRAMS_PER_SM, _norm_gemv_kernel as fn, pick_constants, two_ahead
for k in (2048, 4096, 7168):
    for w, size in (("*bf16", 2), ("*fp32", 4)):
        bk = pow2(k)
        sig = {n: "*bf16" for n in fn.arg_names}
        sig.update(W=w, Y="*fp32" if w == "*fp32" else "*bf16", N="i32", K="i32", eps="fp32", stride_wn="i32",
                   stride_xp="i32", n_blocks="i32")
        for picks in (1, 8, 9):  # a plain row; a one-token MoE step's picks (LayerOps.pick_rows), 9: DeepSeek-V3's
            bn = max(1, _TILE_BYTES // (bk * size))
            consts = dict(**pick_constants(picks, bk), HAS_RESIDUAL=True, HAS_BIAS=False, BLOCK_N=bn,
                          BLOCK_K=bk, TWO_AHEAD=two_ahead(bn, bk, size), USE_PDL=True)
            warps = whole_row_warps(bk)  # as the wrapper launches it
            # as the JIT builds it for the models: K and N multiples of 16 (wide loads)
            u = _usage("norm_gemv", _compile(fn, sig, consts, 90, warps, 1, aligned=("N", "K")))
            print(k, w, picks, u.registers, u.spill_bytes, u.loads_before_wait, u.stores_before_wait)
            assert u.spill_bytes == 0 and u.stores_before_wait == 0 and u.loads_before_wait > 0, u
            # the grid's PROGRAMS_PER_SM programs of an SM fit in its registers at once
            assert -(-u.registers // 8) * 8 * 32 * warps * PROGRAMS_PER_SM <= 65536, u
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v2-lite"])
def test_a_batch_one_engine_on_the_triton_kernels_keeps_the_torch_tokens(name, tmp_path):
    """End to end at batch 1 (every decode step one row: both norms of every layer fused with
    the attention's first product and the MLP's or the router's), fp32 dummy weights of the config
    cut small: the torch path's greedy tokens, logprobs within 1e-4; every norm of a decode step
    went through the kernel."""
    want, got, rows = batch_one_on_both_paths(cut_config(name, tmp_path), DEVICE.type, ng, "norm_gemv", 5)
    assert rows == [1] * (2 * 2 * 4)  # 2 layers x 2 norms x the 4 decode steps after the prefill
    assert_same_tokens(want, got)
