"""A second model family, defined outside ketch: a tiny causal LM whose KV cache is one latent
vector per token and layer (MLA-like), not K and V per head.

    config      ToyConfig: no num_kv_heads / head_dim fields (whatever reads those is Llama-shaped)
    kv_spec     one tensor "c" of [latent_dim] per layer (the pool holds only that)
    weights     HF-style names (`weight_shapes`), loaded by name (`ToyLatentLM.load_weights`)
    attention   LatentAttentionBackend: writes each new token's latent into "c" at its slot,
                reads a sequence's pages back and up-projects them into per-head K and V

A layer: x + o(attn(q(n(x)), c(n(x)))) then x + down(silu(up(n(x)))), with a learned position
table instead of RoPE. Everything is plain torch; `TOY` is registered with
`ketch.models.registry.register_family` by the tests (tests/test_second_family.py), so ketch's
own registry table never names it.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ketch.attention.base import AttentionBackend
from ketch.config import KVSpec, KVTensorSpec
from ketch.forward_batch import ForwardBatch
from ketch.host_copy import to_device
from ketch.models.family import ModelFamily
from ketch.parallel import SINGLE, ParallelContext

ARCHITECTURE = "ToyLatentForCausalLM"
LATENT = "c"  # the one KV tensor per layer


@dataclass(frozen=True)
class ToyConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_query_heads: int
    head_size: int  # per query head; K and V are up-projected to it from the latent
    latent_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ToyConfig":
        eos = d.get("eos_token_id")
        return cls(architecture=d["architectures"][0], vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
                   num_query_heads=d["num_query_heads"], head_size=d["head_size"], latent_dim=d["latent_dim"],
                   max_position_embeddings=d["max_position_embeddings"], rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   bos_token_id=d.get("bos_token_id"), eos_token_ids=() if eos is None else (int(eos),))

    @property
    def q_width(self) -> int:
        return self.num_query_heads * self.head_size


def kv_spec(cfg: ToyConfig, parallel: ParallelContext) -> KVSpec:
    if parallel.world_size != 1:
        raise ValueError("tensor_parallel_size: the toy latent family runs on one rank")
    return KVSpec(cfg.num_layers, (KVTensorSpec(LATENT, (cfg.latent_dim,)),))


def weight_shapes(c: ToyConfig) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.embed_positions.weight": (c.max_position_embeddings, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "attn_norm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_width, c.hidden_size)
        shapes[p + "self_attn.latent_proj.weight"] = (c.latent_dim, c.hidden_size)  # hidden -> cached latent
        shapes[p + "self_attn.k_up.weight"] = (c.q_width, c.latent_dim)  # latent -> K of every head
        shapes[p + "self_attn.v_up.weight"] = (c.q_width, c.latent_dim)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_width)
        shapes[p + "mlp_norm.weight"] = (c.hidden_size,)
        shapes[p + "mlp.up.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


# ---------------------------------------------------------------- attention over the latent pool
@dataclass
class SeqMeta:
    lo: int  # the sequence's new tokens are rows lo:hi of the step
    hi: int
    kv_len: int
    pages: torch.Tensor  # [1, pages] the sequence's page ids
    mask: torch.Tensor  # [new, kv_len] bool: key j visible to new token i iff j <= start + i


@dataclass
class LatentMeta:
    slots: torch.Tensor  # [tokens]
    seqs: list[SeqMeta]


class LatentAttentionBackend(AttentionBackend):
    """Every sequence reads its whole latent history from the pool (its new tokens included,
    just written), so a prefix-cache hit and a chunk boundary look alike to it."""

    def __init__(self, pool: Any, num_heads: int, head_size: int, device: torch.device) -> None:
        self.pool, self.num_heads, self.head_size, self.device = pool, num_heads, head_size, device

    def init_metadata(self, batch: ForwardBatch) -> LatentMeta:
        seqs = []
        for i in range(batch.num_seqs):
            lo, start, n = int(batch.q_starts[i]), int(batch.starts[i]), int(batch.num_new[i])
            pages = to_device(batch.page_table[i : i + 1, : int(batch.pages_used[i])], self.device, torch.long)
            q_pos = torch.arange(start, start + n, device=self.device)
            mask = torch.arange(start + n, device=self.device)[None, :] <= q_pos[:, None]
            seqs.append(SeqMeta(lo, lo + n, start + n, pages, mask))
        return LatentMeta(to_device(batch.slots, self.device, torch.long), seqs)

    # The MHA contract's forward(q, k, v) has no place for a latent cache; this family's layers
    # call this one (the runner itself only ever calls init_metadata).
    def forward(self, q: torch.Tensor, latent: torch.Tensor, layer: int, meta: LatentMeta,  # type: ignore[override]
                k_up: nn.Linear, v_up: nn.Linear) -> torch.Tensor:
        """q: [tokens, heads, head_size]; latent: [tokens, latent_dim] of the new tokens."""
        self.pool.write(layer, LATENT, meta.slots, latent)
        out = torch.empty_like(q)
        h, d = self.num_heads, self.head_size
        for s in meta.seqs:
            c = self.pool.read_pages(layer, LATENT, s.pages)[0, : s.kv_len]  # [kv_len, latent_dim]
            k = k_up(c).view(-1, h, d).transpose(0, 1)
            v = v_up(c).view(-1, h, d).transpose(0, 1)
            o = F.scaled_dot_product_attention(q[s.lo : s.hi].transpose(0, 1), k, v, attn_mask=s.mask)
            out[s.lo : s.hi] = o.transpose(0, 1)
        return out


def latent_attention(config: ToyConfig, pool: Any, *, backend: str, parallel: ParallelContext,
                     device: torch.device, max_model_len: int) -> LatentAttentionBackend:
    """The family's AttentionFactory: one plain-torch implementation, whatever `backend` says."""
    return LatentAttentionBackend(pool, config.num_query_heads, config.head_size, device)


# ---------------------------------------------------------------- the model
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ToyAttention(nn.Module):
    def __init__(self, c: ToyConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.head_size = layer, c.num_query_heads, c.head_size
        self.q_proj = nn.Linear(c.hidden_size, c.q_width, bias=False)
        self.latent_proj = nn.Linear(c.hidden_size, c.latent_dim, bias=False)
        self.k_up = nn.Linear(c.latent_dim, c.q_width, bias=False)
        self.v_up = nn.Linear(c.latent_dim, c.q_width, bias=False)
        self.o_proj = nn.Linear(c.q_width, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, attn: LatentAttentionBackend, meta: LatentMeta) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.heads, self.head_size)
        o = attn.forward(q, self.latent_proj(x), self.layer, meta, self.k_up, self.v_up)
        return self.o_proj(o.reshape(x.shape[0], -1))


class ToyLayer(nn.Module):
    def __init__(self, c: ToyConfig, layer: int) -> None:
        super().__init__()
        self.eps = c.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.self_attn = ToyAttention(c, layer)
        self.mlp_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.mlp = nn.ModuleDict({"up": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
                                  "down": nn.Linear(c.intermediate_size, c.hidden_size, bias=False)})

    def forward(self, x: torch.Tensor, attn: LatentAttentionBackend, meta: LatentMeta) -> torch.Tensor:
        x = x + self.self_attn(rms_norm(x, self.attn_norm, self.eps), attn, meta)
        return x + self.mlp["down"](F.silu(self.mlp["up"](rms_norm(x, self.mlp_norm, self.eps))))


class ToyLatentLM(nn.Module):
    """The `CausalLM` contract (ketch/models/family.py) in plain torch; `ops` is not used."""

    def __init__(self, cfg: ToyConfig, max_positions: int, *, ops: Any = None,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config, self.parallel, self.eps = cfg, parallel, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(ToyLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: LatentAttentionBackend,
                meta: LatentMeta) -> torch.Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x, attn, meta)
        return rms_norm(x, self.norm, self.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names -> our parameters (norm weights are bare Parameters, hence the suffix strip)."""
        params = dict(self.named_parameters())
        seen = set()
        for name, tensor in weights:
            ours = name.removeprefix("model.")
            if ours not in params:
                ours = ours.removesuffix(".weight")
            if ours not in params:
                raise ValueError(f"model: unexpected weight {name!r}")
            params[ours].copy_(tensor)
            seen.add(ours)
        if seen != set(params):
            raise ValueError(f"model: missing weights {sorted(set(params) - seen)}")

    def load_int4(self, weights: Iterable[tuple[str, Any]]) -> int:
        return 0  # never 4-bit: only GGUF files carry such blocks


TOY: ModelFamily[ToyConfig] = ModelFamily(
    name="toy-latent",
    architectures=(ARCHITECTURE,),
    config_from_hf=ToyConfig.from_hf,
    kv_spec=kv_spec,
    weight_shapes=weight_shapes,
    model_class=ToyLatentLM,
    attention_backend=latent_attention,
)

# ---------------------------------------------------------------- a checkpoint
TOY_HF_CONFIG: dict[str, Any] = {
    "architectures": [ARCHITECTURE], "model_type": "toy_latent", "vocab_size": 97, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_query_heads": 4, "head_size": 8, "latent_dim": 6,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "eos_token_id": 2, "bos_token_id": 1,
}


def save_checkpoint(directory: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """config.json + model.safetensors of random weights; returns the weights (fp32)."""
    cfg = ToyConfig.from_hf(TOY_HF_CONFIG)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 1:  # norm weights near 1
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:  # embeddings O(1), linears scaled by fan-in
            scale = 1.0 if "embed" in name else shape[1] ** -0.5
            weights[name] = scale * torch.randn(shape, generator=gen)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TOY_HF_CONFIG))
    save_file(weights, str(directory / "model.safetensors"))
    return weights


__all__ = ["ARCHITECTURE", "LATENT", "TOY", "TOY_HF_CONFIG", "ToyConfig", "save_checkpoint"]
