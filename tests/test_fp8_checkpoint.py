"""Block-scaled fp8 checkpoints (DeepSeek-V3's own format: float8_e4m3fn weights, a
`weight_scale_inv` per [bo, bi] block, `quantization_config.quant_method: fp8`): loaded dequantized,
they are the checkpoint whose weights are those values. A tiny random DeepSeek-V3 MoE checkpoint is
quantized here with ragged 48x40 blocks (the edges are partial blocks); its twin holds the same
values dequantized by a plain loop over the blocks. Every tensor ketch loads from the fp8 one
equals the twin's, and so do the greedy ids and logprobs. Bad fp8 checkpoints are refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ketch.llm import LLM
from ketch.models.registry import family_for, load_model_config
from ketch.sampling.params import SamplingParams
from ketch.weights import iter_weights
from ketch.weights.source import ModelSource, default_model_path

BLOCK = (48, 40)
QUANTIZED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.3,
              eos_token_id=299, bos_token_id=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
              qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
              first_k_dense_replace=1, n_shared_experts=1, n_group=4, topk_group=2, tie_word_embeddings=False)
PROMPTS = [[5 + i for i in range(n)] for n in (9, 21, 4)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, per-block scale): each block's largest |w| maps to fp8's largest normal, 448."""
    rows, cols = -(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1])
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (blk / scale[i, j]).to(q.dtype)
    return q, scale


def dequantized_by_loop(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    w = torch.empty(q.shape)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            w[i, j] = q[i, j].float() * scale[i // BLOCK[0], j // BLOCK[1]]
    return w


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(the fp8 checkpoint, its dequantized twin)."""
    import transformers

    base = tmp_path_factory.mktemp("dense")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**CONFIG),
                                                  dtype=torch.float32).save_pretrained(base)
    fp8, twin = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("twin")
    tensors = load_file(str(base / "model.safetensors"))
    quantized, values = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and any(f".{p}." in name for p in QUANTIZED):
            q, scale = quantize(t)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            values[name] = dequantized_by_loop(q, scale)
        else:
            quantized[name] = values[name] = t
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(values, str(twin / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    (twin / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (fp8 / "config.json").write_text(json.dumps(config))
    assert sum(t.dtype == torch.float8_e4m3fn for t in quantized.values()) >= 20
    return fp8, twin


def loaded(path: Path) -> dict[str, torch.Tensor]:
    source = ModelSource.resolve(str(path), "auto")
    cfg = load_model_config(source)
    return dict(iter_weights(source, family_for(cfg.architecture).weight_shapes(cfg), torch.float32))


def test_every_tensor_loads_as_the_dequantized_twin(checkpoints):
    fp8, twin = checkpoints
    got, want = loaded(fp8), loaded(twin)
    assert got.keys() == want.keys() and not any(k.endswith("_scale_inv") for k in got)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_greedy_ids_and_logprobs_equal_the_twins(checkpoints):
    def run(path: Path):
        llm = LLM(str(path), tokenizer=default_model_path(), dtype="float32", device="cpu", num_threads=1,
                  kv_cache_memory=4 << 20, page_size=8)
        try:
            return [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, PARAMS)]
        finally:
            llm.close()

    fp8, twin = checkpoints
    assert run(fp8) == run(twin)


def _variant(src: Path, dst: Path, config=None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config(json.loads((dst / "config.json").read_text()))))
    if tensors is not None:
        save_file(tensors(load_file(str(dst / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def test_bad_fp8_checkpoints_are_refused(checkpoints, tmp_path):
    fp8, _ = checkpoints
    name = "model.layers.0.self_attn.o_proj.weight"
    no_config = _variant(fp8, tmp_path / "a", config=lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    with pytest.raises(ValueError, match=r"'model\.layers\.\d+\.\S+\.weight' is fp8 without a block scale"):
        loaded(no_config)
    bad_scale = _variant(fp8, tmp_path / "b", tensors=lambda t: {**t, name + "_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ValueError, match=r"o_proj.weight_scale_inv has shape \(1, 1\)"):
        loaded(bad_scale)
    static = _variant(fp8, tmp_path / "c", config=lambda c: {**c, "quantization_config": {
        **c["quantization_config"], "activation_scheme": "static"}})
    with pytest.raises(ValueError, match="activation_scheme"):
        loaded(static)
