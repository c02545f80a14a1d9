"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens of all requests in a step are flattened into one [tokens, hidden] stream; only
attention needs to know where one request ends, and it learns that from the backend metadata.
Projections are fused (q|k|v and gate|up) so a layer runs two big matmuls instead of five.
The residual stream travels beside the hidden states, so each residual add is fused into the
next RMSNorm; norms, RoPE and SiLU·mul go through the `LayerOps` chosen at build time (torch
ops, or the fused Triton kernels on CUDA; ketch/layers/ops.py).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ketch.attention.base import AttentionBackend
from ketch.config import ModelConfig
from ketch.layers.linear import Linear, concat_q4
from ketch.layers.norm import RMSNorm
from ketch.layers.ops import TORCH_OPS, LayerOps
from ketch.layers.q4 import Q4Weight
from ketch.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: LayerOps) -> None:
        super().__init__()
        self.layer = layer
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias, dense=ops.linear)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False, dense=ops.linear)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend, meta: Any) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv_heads
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim)
        if self.q_norm is not None:
            qn, kn = self.q_norm, self.k_norm
            qk = torch.cat((self.ops.rms_norm(qk[:, : self.num_heads], qn.weight, qn.eps),
                            self.ops.rms_norm(qk[:, self.num_heads :], kn.weight, kn.eps)), 1)
        qk = self.ops.rotary(qk, *rope)  # q and k heads rotated in one go (in place with Triton)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = attn.forward(q, k, v, self.layer, meta)
        return self.o_proj(o.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps) -> None:
        super().__init__()
        self.silu_and_mul = ops.silu_and_mul
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dense=ops.linear)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dense=ops.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, still to be added to `residual` (None before the
        first layer: x is the embedding). Returns this layer's MLP output and the residual stream
        before it; each add is fused into the norm that follows it."""
        if residual is None:
            h, residual = self.ops.rms_norm(x, self.input_layernorm.weight, self.eps), x
        else:
            h, residual = self.ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        h = self.self_attn(h, rope, attn, meta)
        h, residual = self.ops.add_rms_norm(h, residual, self.post_attention_layernorm.weight, self.eps)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, ops: LayerOps = TORCH_OPS) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, meta: Any) -> torch.Tensor:
        """Hidden states after the final norm, [tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn, meta)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.ops is not TORCH_OPS:
            return self.ops.linear(hidden, weight, None).float()  # small steps: the skinny GEMM
        if hidden.shape[0] == 1 and hidden.dtype != torch.float32:
            # one row in bf16/fp16: the matrix-vector kernel streams the vocab matrix ~1.8x faster
            # than a 1-row GEMM here; fp32 keeps the reference GEMM so parity stays exact
            return torch.mv(weight, hidden[0]).float()[None]
        return (hidden @ weight.t()).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take HF-named tensors, fusing q/k/v and gate/up; fail loudly on missing or unknown names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            target, offset = self._fused_slot(name)
            if target == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes still carry a copy
            if target not in params:
                raise ValueError(f"model: unexpected weight {name!r}")
            param = params[target]
            dst = param.data if offset is None else param.data.narrow(0, offset, tensor.shape[0])
            if dst.shape != tensor.shape:
                raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(f"{target}@{offset}")
        expected = {f"{n}@{o}" for n, o in self._expected_slots()}
        missing = expected - loaded
        if missing:
            raise ValueError(f"model: missing weights {sorted(missing)[:5]}...")

    def _fused_slot(self, name: str) -> tuple[str, int | None]:
        """HF parameter name -> (our parameter name, row offset inside a fused q|k|v or gate|up)."""
        cfg = self.config
        for part, fused, off in (
            ("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", cfg.q_size),
            ("v_proj", "qkv_proj", cfg.q_size + cfg.kv_size),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", cfg.intermediate_size),
        ):
            if f".{part}." in name:
                return name.replace(part, fused), off
        return name, None

    def load_int4(self, weights: Iterable[tuple[str, Q4Weight]]) -> int:
        """Attach 4-bit copies to the Linear layers whose every part came as 4-bit blocks.
        Returns how many layers got one."""
        parts: dict[str, dict[int, Q4Weight]] = {}
        for name, w in weights:
            target, offset = self._fused_slot(name.removeprefix("model."))
            if target.endswith(".weight"):
                parts.setdefault(target.removesuffix(".weight"), {})[offset or 0] = w
        modules = dict(self.named_modules())
        attached = 0
        for module_name, by_offset in parts.items():
            module = modules.get(module_name)
            if not isinstance(module, Linear):
                continue
            rows = sum(w.q.shape[0] for w in by_offset.values())
            if rows != module.weight.shape[0]:
                continue  # some part of this fused layer was not 4-bit: keep it dense
            module.attach_int4(concat_q4([by_offset[o] for o in sorted(by_offset)]))
            attached += 1
        return attached

    def _expected_slots(self) -> Iterable[tuple[str, int | None]]:
        cfg = self.config
        fused = {
            "qkv_proj.weight": (0, cfg.q_size, cfg.q_size + cfg.kv_size),
            "qkv_proj.bias": (0, cfg.q_size, cfg.q_size + cfg.kv_size),
            "gate_up_proj.weight": (0, cfg.intermediate_size),
        }
        for name, _ in self.named_parameters():
            suffix = ".".join(name.split(".")[-2:])
            if suffix in fused:
                yield from ((name, o) for o in fused[suffix])
            else:
                yield name, None
