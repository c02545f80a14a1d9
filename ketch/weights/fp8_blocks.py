"""Block-scaled fp8 checkpoints (DeepSeek-V3's format, `quantization_config.quant_method: fp8`
with `weight_block_size: [bo, bi]`): a linear weight `W` is stored as float8_e4m3fn with a
companion `W_scale_inv` of shape [ceil(out / bo), ceil(in / bi)], and its value is

    w[i, j] = float(q[i, j]) * scale_inv[i // bo, j // bi]

(the name is DeepSeek's: the stored number multiplies). The loader dequantizes to the model's
dtype on load: the layers and kernels see a plain dense checkpoint. Static activation scales
(`activation_scheme: static`, `input_scale` tensors) are refused: no such checkpoint is served."""
from __future__ import annotations

from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """(bo, bi) of a block-scaled fp8 checkpoint's config.json, None for any other checkpoint."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return None
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config: activation_scheme {q.get('activation_scheme')!r} is not supported "
                         "(only dynamic: no stored activation scales)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config: weight_block_size must be two positive ints, got {block!r}")
    return block[0], block[1]


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """float32 values of a 2-D fp8 weight and its per-block scales."""
    if q.dim() != 2:
        raise ValueError(f"model: fp8 tensor {name!r} has shape {tuple(q.shape)}; block scales need a 2-D weight")
    out, inp = q.shape
    want = (-(-out // block[0]), -(-inp // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"model: {name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; a {tuple(q.shape)} "
                         f"weight in {block[0]}x{block[1]} blocks needs {want}")
    s = scale_inv.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return q.float() * s
