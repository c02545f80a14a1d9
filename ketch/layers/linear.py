"""Linear layer that can also hold its weight as 4-bit blocks for small batches on the CPU.

Decoding a few tokens is a matrix-vector product bound by how many weight bytes stream from
memory: a 4-bit product over the GGUF's own blocks reads ~4x fewer bytes than bf16 and wins the
small steps; beyond a crossover the dense bf16 GEMM wins (~8 tokens with AMX, far more without:
int4_crossover.py measures it per shape at start-up). The choice is by the step's token count;
both forms hold the same quantized weights. The 4-bit product is ketch's C kernel
(ketch/native/q4_matmul.c: activations rounded to int16 per block of 32, exact integer block
products) where it builds, else torch's int4 kernel (bf16 activations).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ketch.layers.ops import FirstProduct
from ketch.layers.q4 import BLOCK, Q4Weight
from ketch.native import q4 as native_q4

INT4_MAX_TOKENS = 8  # crossover on a 2-core Sapphire Rapids (AMX); each machine measures its own at start-up


class TorchInt4:
    """The 4-bit weight in torch's int4 CPU kernel's form (where ketch's own C kernel cannot run:
    no compiler, fp16 activations, scales that fp16 does not hold)."""
    kernel_id = "torch"

    def __init__(self, w: Q4Weight, dtype: torch.dtype) -> None:
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.contiguous(), 2)
        self.scale_zero = torch.stack((w.scale.t(), w.zero.t()), dim=-1).to(dtype).contiguous()  # [in / 32, out, 2]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, BLOCK, self.scale_zero)


def native_int4_runs(dtype: torch.dtype) -> bool:
    """ketch's own 4-bit kernel takes activations of `dtype` on this machine (built, not switched off)."""
    return dtype in native_q4.DTYPES and native_q4.available()


def pack_int4(w: Q4Weight, dtype: torch.dtype) -> "native_q4.NativeQ4 | TorchInt4":
    """ketch's C kernel (ketch/native/q4_matmul.c) where it is built and takes this dtype, else
    torch's."""
    if native_int4_runs(dtype):
        native = native_q4.NativeQ4.pack(w.q, w.scale, w.zero)
        if native is not None:
            return native
    return TorchInt4(w, dtype)


class Linear(nn.Linear):
    int4: "native_q4.NativeQ4 | TorchInt4 | None" = None  # the 4-bit form, when the checkpoint has one
    # steps of up to this many tokens take the 4-bit kernel: measured per shape at start-up
    # (int4_crossover.py, ModelRunner); INT4_MAX_TOKENS until then
    int4_max_tokens: int = INT4_MAX_TOKENS
    # the activations' dtype where the dense weight is kept in another (dense_in_fp32); None: the weight's
    activation_dtype: torch.dtype | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dense: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = F.linear) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.dense = dense  # the dense product: F.linear, or LayerOps.linear (ketch/layers/ops.py)

    def reset_parameters(self) -> None:
        """No random init: every weight comes from the checkpoint or the dummy generator, and the
        loader fails on any part left unloaded (param_loader.load_parameters). nn.Linear's kaiming
        draw only cost start-up: 0.8 s of the 135M model's ~10 s `ketch serve`, minutes for 8B on
        a CPU."""

    def attach_int4(self, w: Q4Weight) -> None:
        if tuple(w.q.shape) != tuple(self.weight.shape):
            raise ValueError(f"model: 4-bit weight shape {tuple(w.q.shape)} != {tuple(self.weight.shape)}")
        self.int4 = pack_int4(w, self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias): the 4-bit kernel for small steps when attached, else the dense product."""
        if self.int4 is not None and x.shape[0] <= self.int4_max_tokens:
            y = self.int4_product(x)
            return y if bias is None else y + bias
        return self.dense(x, self.weight, bias)

    def int4_product(self, x: torch.Tensor) -> torch.Tensor:
        return self.int4.matmul(x)

    def first_product(self) -> FirstProduct | None:
        """This product as a sublayer's first (LayerOps.add_rms_norm_linear may compute it in the
        norm's launch); None where it is not the plain dense product (4-bit or fp32-kept weights)."""
        if self.int4 is not None or self.activation_dtype is not None:
            return None
        return FirstProduct(self.weight, self.bias)

    def dense_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T by the dense path, without bias (what calibration times against int4_product)."""
        return self.dense(x, self.weight, None)


def fp32_dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The dense product of a bf16 model's layer whose dense weight is kept in fp32: rows widened
    (exact), an fp32 GEMM, the result rounded to x's dtype once."""
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)


def dense_in_fp32(modules: Iterable[nn.Module], budget_bytes: int) -> int:
    """Keep the dense copy of every layer that also holds 4-bit blocks in fp32, for a bf16 model
    on a CPU without native bf16. There a bf16 GEMM is emulated, several times slower than fp32,
    so the steps above the crossover (prefill, many streams) ran the 4-bit kernel however large:
    on emulated AVX2 MKL's fp32 GEMM beats its int16 activations from 32 rows (0.36 vs 0.46 ms
    for 32 x 576 x 1536) and by 1.6x at 256. The crossover (int4_crossover.py) times this fp32
    product against the 4-bit kernel per shape, as it timed the bf16 one. The weights are the bf16
    copy's values, widened: the dense product's numbers are those of the bf16 path without its
    roundings of the sums. The fp32 copies take twice the bf16 ones' memory: when the extra bytes
    exceed `budget_bytes` (a large model on a small machine) nothing changes. Returns how many
    layers took it."""
    layers = [m for m in modules if isinstance(m, Linear) and m.int4 is not None and m.weight.dtype != torch.float32]
    extra = sum(m.weight.numel() * (4 - m.weight.element_size()) for m in layers)
    if extra > budget_bytes:
        return 0
    for m in layers:
        m.activation_dtype = m.weight.dtype
        m.weight.data = m.weight.data.float()
        m.dense = fp32_dense
    return len(layers)


def use_activations(modules: Iterable[nn.Module], activations: str) -> int:
    """Every attached native 4-bit product rounds its activations as `activations` says
    (EngineConfig.cpu_activations: ketch/native/q4_matmul.c's int16 or int8); torch's int4 kernel
    (bf16 activations) has no such choice and stays. Returns how many products took it."""
    taken = 0
    for m in modules:
        if isinstance(m, Linear) and isinstance(m.int4, native_q4.NativeQ4):
            m.int4 = m.int4.with_activations(activations)
            taken += 1
    return taken


def concat_q4(parts: list[Q4Weight]) -> Q4Weight:
    """Stack projections along the output dim (q|k|v, gate|up), as the fused dense weight is."""
    return Q4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))
