"""Model code vs HF transformers on tiny random checkpoints of each family we claim:
Llama (with llama3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), tied and untied."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_drained, collect, drain
from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams

BASE = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.3,
    eos_token_id=299, bos_token_id=1,
)
FAMILIES = {
    "llama3": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    import transformers

    cls_name, extra = FAMILIES[request.param]
    cfg = getattr(transformers, cls_name)(**BASE, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, str(path)


def test_greedy_tokens_and_logprobs_match_hf(checkpoint):
    name, hf, path = checkpoint
    engine = Engine(EngineConfig(model=path, dtype="float32", kv_cache_memory=4 << 20, page_size=8))
    prompts = [list(range(5, 5 + n)) for n in (7, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    res = collect(drain(engine))
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            out = hf.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
            ref = out.sequences[0, len(p):].tolist()
            got = res[(str(i), 0)]
            assert got["ids"] == ref, f"{name}: prompt {i}"
            ref_lp = [torch.log_softmax(l[0], -1)[t].item() for l, t in zip(out.logits, ref, strict=True)]
            assert max(abs(a.logprob - b) for a, b in zip(got["logprobs"], ref_lp, strict=True)) < 1e-4
    assert_drained(engine)


@pytest.mark.parametrize("cls_name, extra", [
    ("MistralConfig", dict(sliding_window=16)),  # every layer
    ("Qwen2Config", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1)),  # layer 1 on
], ids=["mistral", "qwen2"])
def test_a_sliding_window_caps_the_context_where_full_attention_equals_it(cls_name, extra, tmp_path):
    """ketch attends to every earlier token; a model whose layers attend through a window of 16
    is that only while the context fits in the window: the context defaults to the window (output
    = HF's, which windows), and a longer max_model_len is refused, naming it, instead of running
    full attention past the window (output silently unlike the model's)."""
    import transformers

    cfg = getattr(transformers, cls_name)(**{**BASE, "tie_word_embeddings": False}, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^max_model_len: 64 is past the model's sliding window \\(16 tokens\\)"):
        Engine(EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=64))
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_memory=4 << 20, page_size=8))
    assert engine.max_model_len == 16
    prompt = list(range(5, 14))
    engine.add_request("w", prompt, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    got = collect(drain(engine))[("w", 0)]["ids"]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=7, min_new_tokens=7, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == ref
    assert_drained(engine)
