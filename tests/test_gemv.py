"""The skinny GEMM (ketch.kernels.gemv) against torch, and its routing in the Triton LayerOps.

Without CUDA it runs in Triton's CPU interpreter (set before triton is imported), fp32 and bf16
inputs (the kernel casts bf16 loads to fp32 at once; only the final fp32 -> bf16 cast of the
interpreter truncates instead of rounding). With CUDA, bf16 on Llama-3.1-8B's shapes vs F.linear.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

import torch.nn.functional as F

from ketch.kernels.gemv import MAX_M, gemv, picked_config
from ketch.layers.ops import GEMV_MAX_M, layer_ops

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def bf16_ulp(ref: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each |ref| (8 significant bits), floored at the ulp of 2^-6 for values near 0."""
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0**-6))) - 7)


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    err = (y.double() - ref).abs()
    if x.dtype == torch.float32:
        # fp32 accumulation of K <= 320 products of N(0,1) values: rounding error ~ sqrt(K) * 2^-24
        # * |terms| stays far below 1e-4 absolute on outputs of size ~sqrt(K) ~ 18
        assert err.max().item() < 1e-4
    else:
        # inputs are exact bf16 values and the sum is fp32, so the error is the single rounding
        # of the output to bf16: half an ulp rounding to nearest, one ulp where the interpreter
        # truncates; the fp32 sum adds ~1e-5 relative, covered by the small extra term
        assert bool((err <= bf16_ulp(ref) * 1.0 + 1e-5 * ref.abs() + 1e-6).all()), err.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(48, 64), (200, 320)])
@pytest.mark.parametrize("m", list(range(1, MAX_M + 1)))
def test_gemv_matches_fp64_reference(m: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)  # N=200 is no multiple of any BLOCK_N
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    y = gemv(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    check(y, x, w, b)


@pytest.mark.parametrize("m", [1, 4])
def test_gemv_widens_a_bf16_x_against_an_fp32_weight(m: int) -> None:
    """DeepSeek's router: bf16 hidden states, fp32 weight, fp32 logits; the same bits as widening
    x first (one launch fewer), and LayerOps.linear_fp32's contract on either op set."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 320, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(200, 320, generator=gen).to(DEVICE)
    y = gemv(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, gemv(x.float(), w))
    check(y, x.float(), w, None)
    for ops in (layer_ops("triton"), layer_ops("torch")):
        fp32 = ops.linear_fp32 or (lambda x, w: ops.linear(x.float(), w.float(), None))
        torch.testing.assert_close(fp32(x, w), F.linear(x.float(), w), rtol=1e-5, atol=1e-4)


def test_gemv_strided_rows_and_columns_past_n_untouched() -> None:
    gen = torch.Generator().manual_seed(7)
    big = torch.randn(3, 400, generator=gen).to(DEVICE)
    x = big[:, :320]  # row stride 400: a view into a wider activation, as qkv slices are
    w = torch.randn(200, 320, generator=gen).to(DEVICE)
    check(gemv(x, w), x, w, None)


@pytest.mark.parametrize("m", [1, 5])
def test_gemv_is_deterministic(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 320, generator=gen).to(DEVICE)
    w = torch.randn(200, 320, generator=gen).to(DEVICE)
    assert torch.equal(gemv(x, w), gemv(x, w))


def test_gemv_rejects_bad_shapes() -> None:
    w = torch.zeros(16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="features"):
        gemv(torch.zeros(1, 31, device=DEVICE), w)
    with pytest.raises(ValueError, match="MAX_M"):
        gemv(torch.zeros(MAX_M + 1, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.zeros(1, 32, device=DEVICE), w, torch.zeros(15, device=DEVICE))


LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@cuda_only
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("name", list(LLAMA_8B))
def test_gemv_matches_cublas_on_llama_8b_shapes(name: str, m: int) -> None:
    n, k = LLAMA_8B[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
    y = gemv(x, w)
    ref = F.linear(x.float(), w.float())  # fp32 reference; F.linear in bf16 is itself rounded
    # both round an fp32 sum once to bf16; sums in different orders may straddle a rounding
    # boundary, so allow 2 ulps at the output's scale (outputs ~N(0,1))
    scale = ref.abs().max()
    assert (y.float() - ref).abs().max() <= 2 * bf16_ulp(scale)
    assert (F.linear(x, w).float() - y.float()).abs().max() <= 2 * bf16_ulp(scale)
    assert torch.equal(y, gemv(x, w))
    assert picked_config(n, k, m) is not None


@cuda_only
@pytest.mark.parametrize("m", [1, 3])
def test_every_autotune_config_gives_the_same_bits(m: int) -> None:
    """The autotuner may pick any config of a path; the result must not depend on which."""
    import triton

    from ketch.kernels._common import pdl_launch
    from ketch.kernels.gemv import DOT_M, _gemv_dot, _gemv_fma, _gemv_kernel

    n, k = LLAMA_8B["down"]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    tuner, block_m = (_gemv_fma, 1) if m == 1 else (_gemv_dot, DOT_M)
    outs = []
    for cfg in tuner.configs:
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        _gemv_kernel[(triton.cdiv(n, cfg.kwargs["BLOCK_N"]),)](
            x, w, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=False, UPCAST=False, PRECISION="tf32", BLOCK_M=block_m, **cfg.all_kwargs(), **pdl_launch())
        outs.append(y)
    assert all(torch.equal(outs[0], y) for y in outs[1:])


@cuda_only
def test_triton_layer_ops_route_small_steps_through_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    import ketch.kernels.gemv as gemv_mod

    calls: list[int] = []

    def counting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return gemv(x, w, b)

    monkeypatch.setattr(gemv_mod, "gemv", counting)
    ops = layer_ops("triton")
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    for m in (1, GEMV_MAX_M, GEMV_MAX_M + 1):
        x = torch.randn(m, 128, device="cuda", dtype=torch.bfloat16)
        y = ops.linear(x, w, None)
        assert y.shape == (m, 256)
    assert calls == [1, GEMV_MAX_M]  # above the threshold: F.linear


def test_torch_layer_ops_linear_is_f_linear() -> None:
    assert layer_ops("torch").linear is F.linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(48, 64), (200, 320), (9, 2048)])
def test_whole_rows_at_one_row_match_the_reference(n: int, k: int, dtype: torch.dtype,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """KETCH_GEMV_WHOLE_K: one program per few whole weight rows (the whole slice requested before
    the PDL wait); the fp64 reference's result, rows past N untouched, the same bits run to run,
    and two rows still take the tiled path (its result unchanged)."""
    from ketch.kernels import gemv as gemv_module

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(2, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype)
    tiled = gemv(x, w, b)
    monkeypatch.setattr(gemv_module, "WHOLE_K", True)
    launched = []
    real = gemv_module._gemv_kernel

    class Watched:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(gemv_module, "_gemv_kernel", Watched())
    y = gemv(x[:1], w, b)
    assert len(launched) == 1 and launched[0][0] < n, launched  # several rows a program
    check(y, x[:1], w, b)
    assert torch.equal(y, gemv(x[:1], w, b))
    assert torch.equal(gemv(x, w, b), tiled)
    assert len(launched) == 2, "the two-row call took the whole-row path"
