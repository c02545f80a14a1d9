"""ketch's C 4-bit product (ketch/native/q4_matmul.c), built for each instruction set this CPU runs.

The kernel rounds each row of x to int16 per block of 32 (or, opt-in, to int8) and multiplies
with the 4-bit blocks in integers; its result is checked against that arithmetic done in float64
from the same rounding (tight: only fp32 summation order separates them), and against the exact
product with the weights as stored, within the bound the rounding allows (half a step of each
block's scale on every activation). Rows are independent of the batch beside them, bit for bit.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ketch.layers.linear import Linear, TorchInt4
from ketch.layers.q4 import Q4Weight
from ketch.native import build, q4

pytestmark = pytest.mark.skipif(build.library_path("q4_matmul", "generic") is None, reason="no C compiler")


def gguf_like(n: int, k: int, seed: int) -> Q4Weight:
    """Q4_1 blocks as the GGUF loader makes them: fp16 d and m, zero = m + 8 d."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    return Q4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32), d, m + 8 * d)


QMAX = {"int16": 32767, "int8": 127}  # the activations' largest rounded value, per mode


def rounded_model(x: torch.Tensor, w: Q4Weight, activations: str = "int16") -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in float64, and the bound of its distance from x @ W^T."""
    qmax = QMAX[activations]
    xf = x.float().view(x.shape[0], -1, 32)  # the rounding in fp32, as the kernel does it
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, qmax / amax.clamp_min(1e-30), 0.0)
    qx, d, xb = torch.round(xf * inv).double(), (amax / qmax).double(), xf.double()
    scale = w.scale.double().repeat_interleave(32, 1)
    qs = w.q.double() * scale
    want = (qx * d).reshape(x.shape) @ qs.t() + xb.sum(-1) @ (w.zero.double() - 8 * w.scale.double()).t()
    step = (d / 2).expand_as(xb).reshape(x.shape)  # an activation moves by at most half a step
    return want, step @ qs.abs().t()


SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (50, 64)]  # 50: a part tile


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activations", list(QMAX))
def test_product_is_the_rounded_arithmetic(native_isa, n, k, dtype, activations):
    w = gguf_like(n, k, seed=n + k)
    packed = q4.NativeQ4.pack(w.q, w.scale, w.zero).with_activations(activations)
    assert q4.library().ketch_q4_isa() == build.ISA_CODE[native_isa]
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[2] = 0  # an all-zero row: scale 0, no division by it
    x[4, 5] = 40.0  # an outlier: its block's other activations keep only a few levels in int8
    y = packed.matmul(x)
    assert y.dtype == dtype and y.shape == (7, n)
    want, bound = rounded_model(x, w, activations)
    out_round = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-6  # the output's own rounding
    tol = out_round * want.abs() + 1e-5 * want.abs().max()
    assert ((y.double() - want).abs() <= tol).all()
    exact = x.double() @ w.dequantize().double().t()
    assert ((y.double() - exact).abs() <= bound + tol).all()
    assert torch.equal(y[2], torch.zeros(n, dtype=dtype))


@pytest.mark.parametrize("activations", list(QMAX))
def test_rows_do_not_depend_on_the_batch(native_isa, activations):
    w = gguf_like(960, 576, seed=1)
    packed = q4.NativeQ4.pack(w.q, w.scale, w.zero).with_activations(activations)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    whole = packed.matmul(x)
    for i in range(9):
        assert torch.equal(packed.matmul(x[i:i + 1]), whole[i:i + 1])
    assert torch.equal(packed.matmul(x[5:9]), whole[5:9])


def test_scales_fp16_cannot_hold_keep_torch_kernel():
    w = gguf_like(64, 64, seed=2)
    odd = Q4Weight(w.q, w.scale * (1 + 2 ** -15), w.zero)  # not an fp16 value any more
    assert q4.NativeQ4.pack(odd.q, odd.scale, odd.zero) is None
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return
    lin = Linear(64, 64, bias=False).to(torch.bfloat16)
    lin.attach_int4(odd)
    assert isinstance(lin.int4, TorchInt4)
    lin.attach_int4(w)
    assert isinstance(lin.int4, q4.NativeQ4)


def test_off_switch_keeps_torch_kernel(monkeypatch):
    monkeypatch.setenv("KETCH_NATIVE_CPU", "0")
    build.load.cache_clear()
    try:
        assert not q4.available()
        if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            lin = Linear(64, 64, bias=False).to(torch.bfloat16)
            lin.attach_int4(gguf_like(64, 64, seed=5))
            assert isinstance(lin.int4, TorchInt4) and lin.int4.kernel_id == "torch"
    finally:
        build.load.cache_clear()


def test_bad_isa_name_is_refused(monkeypatch):
    monkeypatch.setenv("KETCH_NATIVE_ISA", "avx9000")
    with pytest.raises(ValueError, match="KETCH_NATIVE_ISA"):
        build.isa()


def test_emulated_avx2_builds_avx2(monkeypatch):
    monkeypatch.delenv("KETCH_NATIVE_ISA", raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert build.isa() in ("avx2", "generic")


def test_library_is_built_once_and_a_damaged_one_rebuilt(tmp_path):
    """Fresh processes (a loaded library stays mapped: a process never sees its file change)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "KETCH_NATIVE_ISA": "generic"}
    probe = ("from ketch.native import build; lib = build.load('q4_matmul'); "
             "print(lib.ketch_q4_isa(), build.library_path('q4_matmul', 'generic'))")

    def run() -> str:
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        isa_code, path = out.stdout.split()
        assert isa_code == "1" and path.startswith(str(tmp_path))
        return path

    path = Path(run())
    built = path.stat().st_mtime_ns
    assert Path(run()).stat().st_mtime_ns == built  # read back, not built again
    path.write_bytes(b"not a library")
    run()
    assert path.stat().st_size > 1000 and not list(path.parent.glob("*.tmp"))


def test_compiled_graph_calls_the_kernel_as_an_opaque_op():
    w = gguf_like(96, 64, seed=6)
    packed = q4.NativeQ4.pack(w.q, w.scale, w.zero)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(7))

    def f(t: torch.Tensor) -> torch.Tensor:
        return packed.matmul(t * 2) + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), f(x))


def test_threads_agree_bit_for_bit():
    w = gguf_like(3072, 576, seed=8)
    packed = q4.NativeQ4.pack(w.q, w.scale, w.zero)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(9)).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed.matmul(x)
        torch.set_num_threads(max(2, os.cpu_count() or 2))
        assert torch.equal(packed.matmul(x), one)
    finally:
        torch.set_num_threads(before)


def test_int8_activations_are_a_coarser_rounding_not_another_product():
    """The int8 mode is the int16 product with fewer activation levels: its distance from the
    exact product is within its own (larger) bound and larger than the int16 mode's on the
    same rows; the kernel id keeps the crossover cache of the two apart; a bad name is refused."""
    w = gguf_like(576, 576, seed=10)
    packed = q4.NativeQ4.pack(w.q, w.scale, w.zero)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(11))
    exact = x.double() @ w.dequantize().double().t()
    err16 = (packed.matmul(x).double() - exact).abs().mean()
    err8 = (packed.with_activations("int8").matmul(x).double() - exact).abs().mean()
    assert err8 > 20 * err16
    assert packed.with_activations("int8").kernel_id.endswith("-int8") and packed.kernel_id == f"native-{build.isa()}"
    with pytest.raises(ValueError, match="cpu_activations"):
        packed.with_activations("int4")


def test_dense_copies_go_fp32_only_within_the_budget():
    """linear.dense_in_fp32: the layers holding 4-bit blocks keep an fp32 dense copy (bf16 rows in,
    bf16 out) when the extra bytes fit the budget, and stay as they were when they do not."""
    from ketch.layers.linear import dense_in_fp32, fp32_dense

    w = gguf_like(64, 64, seed=12)
    layers = [Linear(64, 64, bias=False).to(torch.bfloat16) for _ in range(2)]
    for lin in layers:
        lin.weight.data.copy_(w.dequantize())
        lin.attach_int4(w)
    extra = 2 * 64 * 64 * 2  # two layers, 2 more bytes a weight
    assert dense_in_fp32(layers, extra - 1) == 0
    assert all(lin.weight.dtype == torch.bfloat16 and lin.activation_dtype is None for lin in layers)
    assert dense_in_fp32(layers, extra) == 2
    assert all(lin.weight.dtype == torch.float32 and lin.activation_dtype == torch.bfloat16 for lin in layers)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(13)).bfloat16()
    assert torch.equal(layers[0].dense_product(x), fp32_dense(x, layers[0].weight, None))
    assert layers[0].dense_product(x).dtype == torch.bfloat16


def test_argument_types_are_declared():
    lib = q4.library()
    assert lib.ketch_q4_matmul.argtypes[4] is ctypes.c_int64  # M as 64 bits, not a C int
    assert lib.ketch_q4_matmul_i8.argtypes[4] is ctypes.c_int64
