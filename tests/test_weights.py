"""Weights: path detection, GGUF/safetensors/dummy loaders, parity with transformers' loaders."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from ketch.config import ModelConfig, RopeScaling
from ketch.models import expected_weight_names, load_model_config, weight_shapes
from ketch.weights import default_model_path, detect_format, iter_weights
from ketch.weights.gguf_file import GGUFFile
from ketch.weights.gguf_loader import unpermute_rotary
from ketch.weights.gguf_rope import llama3_divisors

GGUF = default_model_path()


def hf_from_gguf(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to llama q/k rows (written from its description, for tests)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- the bundled SmolLM2 against transformers' own GGUF loader -----------------------------------


@pytest.fixture(scope="module")
def hf_model(hf_smollm):
    return hf_smollm


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return load_model_config(None)


@pytest.fixture(scope="module")
def ours_f32(config):
    return dict(iter_weights(None, weight_shapes(config), torch.float32))


def test_default_model_path_is_the_bundled_gguf():
    assert GGUF.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(GGUF)


def test_gguf_config_matches_transformers(config, hf_model):
    hf = hf_model.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (hf.vocab_size, hf.hidden_size, hf.intermediate_size)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim
    )
    assert config.rms_norm_eps == hf.rms_norm_eps and config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.max_position_embeddings == hf.max_position_embeddings == 8192
    assert config.tie_word_embeddings is True and hf.tie_word_embeddings is True
    assert config.rope_scaling is None and not config.attention_bias and not config.qk_norm
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


def test_gguf_tensors_equal_transformers_bit_for_bit(config, ours_f32, hf_model):
    hf = hf_model.state_dict()
    assert set(ours_f32) == expected_weight_names(config) == set(hf) - {"lm_head.weight"}
    for name, tensor in ours_f32.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, hf[name]), name
    assert torch.equal(hf["lm_head.weight"], ours_f32["model.embed_tokens.weight"])  # tied


def test_qk_rows_are_unpermuted_and_v_is_not(ours_f32, hf_model, config):
    g = GGUFFile(GGUF)
    hf = hf_model.state_dict()
    raw_q = torch.from_numpy(dequantize(g.data("blk.0.attn_q.weight"), g.tensors["blk.0.attn_q.weight"].ggml_type))
    raw_k = torch.from_numpy(dequantize(g.data("blk.0.attn_k.weight"), g.tensors["blk.0.attn_k.weight"].ggml_type))
    raw_v = torch.from_numpy(dequantize(g.data("blk.0.attn_v.weight"), g.tensors["blk.0.attn_v.weight"].ggml_type))
    assert not torch.equal(raw_q, hf["model.layers.0.self_attn.q_proj.weight"])  # the file really is permuted
    assert torch.equal(unpermute_rotary(raw_q, config.num_heads), hf["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(unpermute_rotary(raw_k, config.num_kv_heads), hf["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(raw_v, hf["model.layers.0.self_attn.v_proj.weight"])


def test_unpermute_inverts_the_converter_permutation():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert torch.equal(unpermute_rotary(torch.from_numpy(llamacpp_permute(w, 3)), 3), torch.from_numpy(w))
    b = np.arange(16, dtype=np.float32)  # biases go through the same row permutation
    assert unpermute_rotary(torch.from_numpy(llamacpp_permute(b, 2)), 2).tolist() == b.tolist()


def test_gguf_bf16_is_a_single_cast_of_the_f32_values(config, ours_f32):
    for name, tensor in itertools.islice(iter_weights(GGUF, weight_shapes(config), torch.bfloat16), 12):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, ours_f32[name].to(torch.bfloat16)), name


# --- path detection and bad input ---------------------------------------------------------------


def _tiny_hf_dict(**over) -> dict:
    d = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    d.update(over)
    return d


def test_detect_format(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(_tiny_hf_dict()))
    assert detect_format(GGUF, "auto") == "gguf" and detect_format(GGUF, "gguf") == "gguf"
    assert detect_format(GGUF, "dummy") == "dummy"
    assert detect_format(str(hf_dir), "auto") == "hf" and detect_format(str(hf_dir), "dummy") == "dummy"
    assert detect_format(str(hf_dir / "config.json"), "dummy") == "dummy"
    with pytest.raises(ValueError, match="load_format='dummy'"):
        detect_format(str(hf_dir / "config.json"), "auto")
    with pytest.raises(ValueError, match="needs a directory"):
        detect_format(GGUF, "hf")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        detect_format(str(hf_dir), "gguf")
    with pytest.raises(ValueError, match="no config.json"):
        detect_format(str(tmp_path), "auto")
    with pytest.raises(ValueError, match="load_format must be"):
        detect_format(GGUF, "pt")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither"):
        detect_format(str(tmp_path / "weights.bin"), "auto")


def test_missing_path_is_a_value_error_naming_model(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    for call in (lambda: load_model_config(missing), lambda: iter_weights(missing, None, torch.float32)):
        with pytest.raises(ValueError, match=r"model: path .* does not exist"):
            call()


@pytest.mark.parametrize("content", [b"", b"not a gguf at all", b"GGUF\x03\x00\x00\x00" + b"\xff" * 16])
def test_corrupt_gguf_is_a_value_error_naming_model(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="model: .*bad.gguf"):
        load_model_config(str(bad))


def test_truncated_gguf_is_a_value_error(tmp_path, config):
    cut = tmp_path / "cut.gguf"
    with open(GGUF, "rb") as f:
        cut.write_bytes(f.read(8_000_000))  # header intact, tensor data cut short
    with pytest.raises(ValueError, match="model: .*past the end"):
        iter_weights(str(cut), weight_shapes(config), torch.float32)


def test_corrupt_safetensors_and_config_are_value_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_hf_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    cfg = load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="model: .*safetensors"):
        iter_weights(str(tmp_path), weight_shapes(cfg), torch.float32)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="model: cannot read"):
        load_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model: .*lacks"):
        load_model_config(str(tmp_path))


# --- HF directories (safetensors) ---------------------------------------------------------------


def _hf_model(d: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**d), dtype=torch.float32)


@pytest.mark.parametrize(
    "d",
    [
        _tiny_hf_dict(),
        _tiny_hf_dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
        _tiny_hf_dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=24),
    ],
    ids=["llama", "qwen2", "qwen3"],
)
def test_hf_dir_round_trip_and_names_match_transformers(tmp_path, d):
    model = _hf_model(d)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards + an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg = load_model_config(str(tmp_path))
    hf = model.state_dict()
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight")
    assert {n: tuple(t.shape) for n, t in hf.items()} == weight_shapes(cfg)
    ours = dict(iter_weights(str(tmp_path), weight_shapes(cfg), torch.bfloat16))
    assert set(ours) == set(hf)
    assert all(ours[n].dtype == torch.bfloat16 and torch.equal(ours[n], hf[n].to(torch.bfloat16)) for n in hf)


def test_hf_config_merges_generation_config_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_hf_dict(eos_token_id=2)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model_config(str(tmp_path), "dummy").eos_token_ids == (2, 7)


def test_shape_mismatch_is_reported(tmp_path):
    _hf_model(_tiny_hf_dict()).save_pretrained(tmp_path)
    cfg = load_model_config(str(tmp_path))
    wrong = dataclasses.replace(cfg, intermediate_size=80)
    with pytest.raises(ValueError, match="model: tensor .* has shape"):
        list(iter_weights(str(tmp_path), weight_shapes(wrong), torch.float32))


# --- dummy weights ------------------------------------------------------------------------------


def test_dummy_weights_shapes_values_and_determinism(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_tiny_hf_dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"])))
    cfg = load_model_config(str(path), "dummy")
    a = dict(iter_weights(str(path), weight_shapes(cfg), torch.bfloat16, load_format="dummy", seed=3))
    b = dict(iter_weights(str(path), weight_shapes(cfg), torch.bfloat16, load_format="dummy", seed=3))
    c = dict(iter_weights(str(path), weight_shapes(cfg), torch.bfloat16, load_format="dummy", seed=4))
    assert {n: tuple(t.shape) for n, t in a.items()} == weight_shapes(cfg)
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert torch.equal(a["model.layers.0.self_attn.q_proj.bias"], torch.zeros(64, dtype=torch.bfloat16))
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], a["model.layers.1.self_attn.q_proj.weight"])
    assert abs(a["model.embed_tokens.weight"].float().std().item() - 0.02) < 0.002


def test_dummy_weights_from_gguf_config_are_generated_lazily(config):
    name, embed = next(iter_weights(GGUF, weight_shapes(config), torch.float32, load_format="dummy"))
    assert name == "model.embed_tokens.weight" and embed.shape == (config.vocab_size, config.hidden_size)
    assert abs(embed.std().item() - 0.02) < 0.001  # random, not the file's values
    # Llama-3-8B layer shapes (small vocab to keep the test fast): tensors appear one at a time.
    big = ModelConfig("LlamaForCausalLM", 4096, 4096, 14336, 32, 32, 8, 128, tie_word_embeddings=False)
    it = iter_weights(None, weight_shapes(big), torch.bfloat16, load_format="dummy")
    got = [next(it) for _ in range(3)]
    assert [n for n, _ in got] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert got[2][1].shape == (4096, 4096) and got[2][1].dtype == torch.bfloat16


# --- synthetic GGUF files for the other architectures -------------------------------------------


def _write_gguf(path, arch: str, cfg: dict, tensors: dict[str, np.ndarray], quant: dict[str, GGMLQuantizationType] | None = None, extra=None):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg["layers"])
    w.add_context_length(512)
    w.add_embedding_length(cfg["hidden"])
    w.add_feed_forward_length(cfg["inter"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv"])
    w.add_rope_freq_base(cfg.get("theta", 10000.0))
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(cfg["vocab"])
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, arr in tensors.items():
        qtype = (quant or {}).get(name)
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quantize(arr, qtype), raw_shape=quantize(arr, qtype).shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _synthetic(arch: str, layers=2, hidden=64, heads=4, kv=2, inter=128, vocab=256, head_dim=None, tied=False):
    rng = np.random.default_rng(1)
    hd = head_dim or hidden // heads
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    t = {"token_embd.weight": r(vocab, hidden), "output_norm.weight": r(hidden)}
    if not tied:
        t["output.weight"] = r(vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": r(hidden), p + "ffn_norm.weight": r(hidden),
              p + "attn_q.weight": r(heads * hd, hidden), p + "attn_k.weight": r(kv * hd, hidden),
              p + "attn_v.weight": r(kv * hd, hidden), p + "attn_output.weight": r(hidden, heads * hd),
              p + "ffn_gate.weight": r(inter, hidden), p + "ffn_up.weight": r(inter, hidden), p + "ffn_down.weight": r(hidden, inter)}
        if arch == "qwen2":
            t |= {p + "attn_q.bias": r(heads * hd), p + "attn_k.bias": r(kv * hd), p + "attn_v.bias": r(kv * hd)}
        if arch == "qwen3":
            t |= {p + "attn_q_norm.weight": r(hd), p + "attn_k_norm.weight": r(hd)}
    cfg = dict(layers=layers, hidden=hidden, heads=heads, kv=kv, inter=inter, vocab=vocab)
    quant = {n: GGMLQuantizationType.Q8_0 for n in t if n.endswith(("ffn_up.weight", "attn_v.weight"))}
    quant |= {n: GGMLQuantizationType.F16 for n in t if n.endswith("ffn_down.weight")}
    return cfg, t, quant


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_gguf_matches_transformers(tmp_path, arch):
    # Qwen3 keeps head_dim 128 whatever the width, so llama.cpp writes attention.key_length; use a
    # width where hidden // heads != head_dim. (transformers ignores that key for qwen3 and assumes
    # Qwen3Config's default of 128, so the two agree only because 128 is what real Qwen3s use.)
    head_dim = 128 if arch == "qwen3" else None
    extra = {"qwen3.attention.key_length": 128} if arch == "qwen3" else None
    cfg, tensors, quant = _synthetic(arch, tied=arch == "qwen3", head_dim=head_dim)
    if arch == "llama":  # store q/k the way the llama converter would
        for n in list(tensors):
            if ".attn_q." in n or ".attn_k." in n:
                tensors[n] = llamacpp_permute(tensors[n], cfg["heads"] if ".attn_q." in n else cfg["kv"])
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, arch, cfg, tensors, quant, extra)
    ours_cfg = load_model_config(str(path))
    assert ours_cfg.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert ours_cfg.attention_bias == (arch == "qwen2") and ours_cfg.qk_norm == (arch == "qwen3")
    assert ours_cfg.tie_word_embeddings == (arch == "qwen3") and ours_cfg.eos_token_ids == (2,)
    assert ours_cfg.head_dim == (head_dim or 16)
    ours = dict(iter_weights(str(path), weight_shapes(ours_cfg), torch.float32))
    hf = hf_from_gguf(str(path)).state_dict()
    if ours_cfg.tie_word_embeddings:
        hf.pop("lm_head.weight")
    assert set(ours) == set(hf) == expected_weight_names(ours_cfg)
    for name in hf:
        assert torch.equal(ours[name], hf[name]), name


def test_gguf_head_dim_from_key_length_and_llama3_rope_freqs(tmp_path):
    cfg, tensors, _ = _synthetic("llama", layers=1, hidden=64, heads=2, kv=1, head_dim=48)
    expected = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    tensors["rope_freqs.weight"] = llama3_divisors(expected, 48, 10000.0).astype(np.float32)
    # A direct transcription of the Llama 3.1 reference formula, as an independent check.
    ref = []
    for i in range(24):
        wavelen = 2 * math.pi * 10000.0 ** (2 * i / 48)
        smooth = (64 / wavelen - 1) / 3
        ref.append(1.0 if wavelen < 16 else 8.0 if wavelen > 64 else 1 / ((1 - smooth) / 8 + smooth))
    np.testing.assert_allclose(tensors["rope_freqs.weight"], ref, rtol=1e-6)
    assert 1.0 in ref and 8.0 in ref and any(1.0 < r < 8.0 for r in ref)  # all three regimes occur
    path = tmp_path / "llama31.gguf"
    _write_gguf(path, "llama", cfg, tensors, extra={"llama.attention.key_length": 48, "llama.rope.scaling.original_context_length": 64})
    got = load_model_config(str(path))
    assert got.head_dim == 48 and got.rope_scaling == expected
    names = {n for n, _ in iter_weights(str(path), weight_shapes(got), torch.float32)}
    assert names == expected_weight_names(got)  # rope_freqs folded into the config, not yielded

    tensors["rope_freqs.weight"] = np.linspace(1, 3, 24, dtype=np.float32)
    _write_gguf(path, "llama", cfg, tensors, extra={"llama.attention.key_length": 48})
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model_config(str(path))
    _write_gguf(tmp_path / "yarn.gguf", "llama", cfg, {}, extra={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        load_model_config(str(tmp_path / "yarn.gguf"))


def test_unsupported_gguf_architecture(tmp_path):
    _write_gguf(tmp_path / "x.gguf", "gpt2", dict(layers=1, hidden=8, heads=1, kv=1, inter=8, vocab=8), {})
    with pytest.raises(ValueError, match="model: GGUF architecture 'gpt2'"):
        load_model_config(str(tmp_path / "x.gguf"))
