"""GGUF -> config.json's dict and Hugging Face-named tensors, value-identical to transformers' GGUF loader.

Values: `gguf.quants.dequantize`'s (what transformers calls) in float32, then one cast to the target
dtype, so a float32 load equals `from_pretrained(..., gguf_file=...)` bit for bit. Q4_0, Q4_1 and
Q8_0 blocks are decoded in torch to the same values (gguf_dequant.py), the rest by gguf itself.

Layout: GGUF dims are fastest-first, so a tensor written as [in, out] reads back as numpy
[out, in], which is already the HF Linear layout; no transposes are needed.

Q/K rows: for `llama` the converter (convert_hf_to_gguf.py) reorders each head's q/k rows from
HF's half-split rotary layout [x0..x(d/2-1), y0..y(d/2-1)] to ggml's interleaved [x0, y0, x1, y1, ..]
(k uses the kv head count). We undo that, with the head counts the file's own metadata gives.
qwen2/qwen3 use NeoX rope in ggml and are not permuted.

Config: the metadata is translated into the keys a config.json would have (`hf_config_from_gguf`),
so the model family reads one format whatever the file (ketch/models/registry.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dataclasses

import numpy as np
import torch
from gguf.quants import dequantize

from ketch.weights.gguf_dequant import dequantize_blocks
from ketch.weights.gguf_file import GGUFFile
from ketch.weights.gguf_rope import rope_scaling_from_gguf

# general.architecture -> (HF architecture, q/k permuted by the converter)
_ARCHS = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that are not parameters of the HF model (rope_freqs is folded into the config).
_SKIP = {"rope_freqs.weight"}


def open_gguf(path: str) -> GGUFFile:
    try:
        return GGUFFile(path)
    except ValueError as e:
        raise ValueError(f"model: {path!r} is not a readable GGUF file: {e}") from None


def _arch(meta: dict[str, Any], path: str) -> str:
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"model: GGUF architecture {arch!r} in {path!r} is not supported ({sorted(_ARCHS)} are)")
    return arch


def _uniform(value: Any, key: str) -> int:
    # Some files give per-layer lists; we only handle models where every layer agrees.
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ValueError(f"model: GGUF {key} varies across layers ({value}); unsupported")
        value = value[0]
    return int(value)


def _head_counts(meta: dict[str, Any], arch: str) -> tuple[int, int]:
    """(q heads, kv heads) as the file says them."""
    if f"{arch}.attention.head_count" not in meta:
        raise ValueError(f"model: GGUF metadata lacks {arch}.attention.head_count")
    heads = _uniform(meta[f"{arch}.attention.head_count"], "attention.head_count")
    return heads, _uniform(meta.get(f"{arch}.attention.head_count_kv", heads), "attention.head_count_kv")


def hf_config_from_gguf(path: str, parsed: GGUFFile | None = None) -> dict[str, Any]:
    """The config.json a Hugging Face checkpoint of this GGUF file would carry (the keys we read)."""
    g = parsed or open_gguf(path)
    meta = g.metadata
    arch = _arch(meta, path)

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"model: GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads, kv_heads = _head_counts(meta, arch)
    head_dim = int(
        meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // heads
    )
    theta = float(key("rope.freq_base", 10000.0))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise ValueError(f"model: GGUF has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    rope_freqs = None
    if "rope_freqs.weight" in g.tensors:
        rope_freqs = dequantize(g.data("rope_freqs.weight"), g.tensors["rope_freqs.weight"].ggml_type)
    scaling = rope_scaling_from_gguf(meta, arch, rope_freqs, head_dim, theta)
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return {
        "architectures": [_ARCHS[arch][0]],
        "model_type": arch,  # llama.cpp's names for these three are transformers' model types
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": _uniform(key("feed_forward_length"), "feed_forward_length"),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": None if scaling is None else dataclasses.asdict(scaling),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in g.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(meta[k]) for k in eos_keys if k in meta)),
    }


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{suffix}"
    raise ValueError(f"model: GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, rows [x0, y0, x1, y1, ..] (ggml interleaved) -> [x0, x1, .., y0, y1, ..] (HF)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFWeights:
    """Iterates (hf_name, tensor) over a GGUF file, dequantizing one tensor at a time."""

    def __init__(self, path: str, dtype: torch.dtype) -> None:
        self.gguf = open_gguf(path)
        self.dtype = dtype
        arch = _arch(self.gguf.metadata, path)
        self.permute_qk = _ARCHS[arch][1]
        self.heads, self.kv_heads = _head_counts(self.gguf.metadata, arch)
        self.names = [n for n in self.gguf.tensors if n not in _SKIP]
        for n in self.names:  # fail on unknown tensors before the first yield
            hf_name(n)

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield hf_name(name), self._load(name)

    def _load(self, name: str) -> torch.Tensor:
        info = self.gguf.tensors[name]
        t = dequantize_blocks(self.gguf.data(name), info.ggml_type, info.shape)  # Q4_0/Q4_1/Q8_0 in torch
        if t is None:
            values = dequantize(self.gguf.data(name), info.ggml_type)
            if not values.flags.writeable:  # a plain F32 tensor is a view of the read-only mapping
                values = values.copy()
            t = torch.from_numpy(np.ascontiguousarray(values))
        t = t.to(self.dtype)
        heads = self.rotary_heads(name)
        if heads:
            t = unpermute_rotary(t, heads)
        return t.contiguous()

    def rotary_heads(self, gguf_name: str) -> int | None:
        """The head count whose rows the converter permuted in this tensor (q or k), else None."""
        if not self.permute_qk:
            return None
        return self.heads if ".attn_q." in gguf_name else self.kv_heads if ".attn_k." in gguf_name else None
