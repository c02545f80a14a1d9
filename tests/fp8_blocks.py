"""DeepSeek-V3-style fp8 expert weights for the fused MoE kernel tests: e4m3 values with one
fp32 scale per 128 x 128 block (absmax / 448), and their dequantized fp32 reference."""
import torch

FP8_BLOCK = 128


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> fp8 e4m3 weights and fp32 scales [E, ceil(N/128), ceil(K/128)] (absmax per block)."""
    e, n, k = w.shape
    pn, pk = -(-n // FP8_BLOCK) * FP8_BLOCK, -(-k // FP8_BLOCK) * FP8_BLOCK
    padded = torch.zeros(e, pn, pk)
    padded[:, :n, :k] = w
    blocks = padded.view(e, pn // FP8_BLOCK, FP8_BLOCK, pk // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(2, 4)) / 448.0
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, pn, pk)[:, :n, :k].contiguous()
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(FP8_BLOCK, 1).repeat_interleave(FP8_BLOCK, 2)
    return q.float() * full[:, : q.shape[1], : q.shape[2]]
