"""ketch's C layer ops (ketch/native/layer_ops.c) against torch's ops of the same contract on bf16
rows: RoPE bit for bit (products and sums of bf16 values, rounded where torch rounds); the norms
within one bf16 step of torch's (a sum of squares in another order can move an fp32 value across
a rounding boundary, never further)."""
from __future__ import annotations

import pytest
import torch

from ketch.config import EngineConfig
from ketch.layers import ops
from ketch.layers.rotary import apply_rotary
from ketch.native import build
from ketch.native import layer_ops as native

pytestmark = pytest.mark.skipif(build.library_path("layer_ops", "generic") is None, reason="no C compiler")
G = torch.Generator().manual_seed(0)


def within_one_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    """|got - want| <= one bf16 step at want's magnitude (8 significant bits)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    g, w = got.float(), want.float()
    step = torch.where(w == 0, torch.tensor(1e-38), w.abs() * 2.0 ** -7)
    return bool(((g - w).abs() <= step).all())


@pytest.mark.parametrize("tokens", [1, 3, 40])  # 40: the threaded path
def test_norms_follow_torch(tokens):
    nat = ops.native_ops(torch.bfloat16)
    x = (torch.randn(tokens, 576, generator=G) * 3).bfloat16()
    x[:, 7] = 2000  # an outlier channel, as SmolLM2 has
    res = (torch.randn(tokens, 576, generator=G) * 100).bfloat16()
    w = torch.randn(576, generator=G).bfloat16()
    assert within_one_step(nat.rms_norm(x, w, 1e-5), ops.TORCH_OPS.rms_norm(x, w, 1e-5))
    (y, s), (y_ref, s_ref) = nat.add_rms_norm(x, res, w, 1e-5), ops.TORCH_OPS.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(s, s_ref)  # one rounded add
    assert within_one_step(y, y_ref)


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rotary_in_place_is_torch_bit_for_bit(tokens):
    qkv = torch.randn(tokens, 960, generator=G).bfloat16()
    qk = qkv[:, :768].view(tokens, 12, 64)  # q and k heads inside the fused rows, as the model has them
    pos = torch.randint(0, 4000, (tokens,), generator=G)
    freqs = pos[:, None].float() / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None].bfloat16()
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None].bfloat16()
    want = apply_rotary(qk.clone(), cos, sin)
    v_before = qkv[:, 768:].clone()
    got = ops.native_ops(torch.bfloat16).rotary(qk, cos, sin)
    assert torch.equal(got, want) and got.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, 768:], v_before)  # the v columns are not touched


def test_what_the_c_code_does_not_take_runs_the_fallback():
    calls = []
    norm = native.make_rms_norm(lambda *a: calls.append("norm") or ops.TORCH_OPS.rms_norm(*a))
    x = torch.randn(4, 64, generator=G).bfloat16()
    w = torch.randn(64, generator=G).bfloat16()
    norm(x.t().contiguous().t(), w, 1e-5)  # strided rows
    norm(x.float(), w.float(), 1e-5)  # fp32
    assert calls == ["norm", "norm"]
    norm(x, w, 1e-5)
    assert calls == ["norm", "norm"]


def test_the_cpu_default_is_native_with_torchs_norms_in_fp32():
    assert EngineConfig(device="cpu").resolved_layer_kernels == "native"
    assert EngineConfig(device="cpu", cpu_compile=True).resolved_layer_kernels == "torch"
    assert ops.layer_ops("native", torch.bfloat16).name == "native"
    fp32 = ops.layer_ops("native", torch.float32)
    # parity with HF: torch's norms and RoPE bit for bit; only few-row products are ketch's own
    assert (fp32.rms_norm, fp32.add_rms_norm, fp32.rotary) == (ops.TORCH_OPS.rms_norm, ops.TORCH_OPS.add_rms_norm,
                                                              ops.TORCH_OPS.rotary)
    assert fp32.linear is not ops.TORCH_OPS.linear
    with pytest.raises(ValueError, match="layer_kernels"):
        EngineConfig(layer_kernels="fast")


def test_off_switch_gives_torch_ops(monkeypatch):
    monkeypatch.setenv("KETCH_NATIVE_CPU", "0")
    build.load.cache_clear()
    try:
        assert ops.native_ops(torch.bfloat16) is ops.TORCH_OPS
        assert ops.native_ops(torch.float32) is ops.TORCH_OPS
    finally:
        build.load.cache_clear()
