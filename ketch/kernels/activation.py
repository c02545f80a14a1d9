"""SiLU-and-mul over the fused [gate | up] projection (ketch/layers/activation.py):
out = silu(gate) * up, with silu rounded to the activation dtype before the product, as
torch's two bf16 ops do. The reference is the layer's own torch function (tests/test_kernels.py
takes it from there: a kernel does not import layers/).

    grid: (rows, ceil(inter / BLOCK))
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ketch.kernels._common import pdl_launch, pow2


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, stride_g, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    if USE_PDL:  # gate_up is the previous kernel's output
        if EARLY_TRIGGER:  # a one-wave grid (KETCH_PDL_EARLY): the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    g = tl.load(GateUp + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + row * stride_g + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    dt = Out.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * u).to(dt), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * inter] → [..., inter]."""
    inter = gate_up.shape[-1] // 2
    if gate_up.shape[-1] != 2 * inter:
        raise ValueError(f"gate_up: last dim {gate_up.shape[-1]} is not even")
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(1024, pow2(inter))
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4 if block >= 512 else 1,
            **pdl_launch(x.shape[0] * triton.cdiv(inter, block)),
        )
    return out.view(*gate_up.shape[:-1], inter)
