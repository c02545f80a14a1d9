"""Qwen3-MoE and Mixtral (ketch/models/moe_*.py) vs HF transformers on tiny random checkpoints
(`from_config` + `save_pretrained`, fp32, CPU): HF's greedy tokens and chosen-token logprobs
within 1e-4 for 16 prompts x 32 tokens through `ketch.LLM`, all in one batch; a second pass that
hits the prefix cache gives the same; and with chunked prefill. HF's greedy choices are read
from one teacher-forced HF forward over each finished sequence (`check`): the same criterion as
`generate`, step by step, at a fraction of the time."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from conftest import assert_drained
from ketch.llm import LLM
from ketch.models.registry import family_for, load_model_config
from ketch.sampling.params import SamplingParams
from ketch.weights.source import default_model_path

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.3, eos_token_id=299, bos_token_id=1,
            num_experts_per_tok=2, tie_word_embeddings=False)
CHECKPOINTS = {
    # layer 1 dense (mlp_only_layers, intermediate_size 96), layers 0 and 2 sparse; k weights as softmax gives them
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_experts=8, moe_intermediate_size=32, head_dim=32,
                                         norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1)),
    # every second layer sparse (decoder_sparse_step 2: layer 1), renormalised top-k
    "qwen3_moe_norm": ("Qwen3MoeConfig", dict(num_hidden_layers=2, num_experts=8, moe_intermediate_size=32,
                                              norm_topk_prob=True, decoder_sparse_step=2)),
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=8)),
}
NEW_TOKENS = 32
LOGPROB_TOL = 1e-4
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


def prompts() -> list[list[int]]:
    """16 prompts of 5..40 tokens; half of them share a 20-token prefix (prefix-cache hits within a batch)."""
    rng = random.Random(0)
    shared = [rng.randrange(2, 299) for _ in range(20)]
    out = []
    for i in range(16):
        own = [rng.randrange(2, 299) for _ in range(rng.randrange(5, 21))]
        out.append(shared + own if i % 2 else own + [rng.randrange(2, 299) for _ in range(rng.randrange(0, 20))])
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops run fastest on one thread (and CI has two cores); given back at module teardown."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """(name, path, the HF model)."""
    import transformers

    cls_name, extra = CHECKPOINTS[request.param]
    cfg = getattr(transformers, cls_name)(**BASE, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, str(path), hf


def make_llm(path: str, **kw) -> LLM:
    # the checkpoint has no tokenizer; prompts are ids, any tokenizer satisfies LLM
    return LLM(path, dtype="float32", kv_cache_memory=8 << 20, page_size=8, tokenizer=default_model_path(),
               num_threads=1, **kw)


@torch.inference_mode()
def check(name: str, hf, outputs) -> None:
    """HF's greedy choice at every step: one HF forward over each prompt + ketch's tokens (right
    padded: causal attention and per-token experts never read the padding) must pick ketch's
    token at every position (so HF's own greedy decode is this sequence) with its logprob
    within 1e-4."""
    seqs = [p + out.token_ids for p, out in zip(prompts(), outputs, strict=True)]
    batch = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = torch.tensor(s)
    logprobs = torch.log_softmax(hf(batch).logits.float(), -1)
    for i, (p, out) in enumerate(zip(prompts(), outputs, strict=True)):
        assert len(out.token_ids) == NEW_TOKENS
        steps = logprobs[i, len(p) - 1 : len(p) - 1 + NEW_TOKENS]
        assert steps.argmax(-1).tolist() == out.token_ids, f"{name}: prompt {i} diverges from HF's greedy choice"
        ref = steps.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert (got - ref).abs().max().item() < LOGPROB_TOL, f"{name}: prompt {i} logprobs"


def test_family_and_checkpoint_names(checkpoint):
    name, path, _ = checkpoint
    cfg = load_model_config(path)
    assert family_for(cfg.architecture).name == "moe"
    assert [cfg.is_sparse(i) for i in range(cfg.num_layers)] == {
        "qwen3_moe": [True, False, True], "qwen3_moe_norm": [False, True], "mixtral": [True, True]}[name]
    assert cfg.norm_topk_prob == (name != "qwen3_moe") and cfg.qk_norm == name.startswith("qwen3")


def test_batched_then_prefix_cache_hits(checkpoint):
    name, path, hf = checkpoint
    llm = make_llm(path)
    check(name, hf, llm.generate(prompts(), PARAMS))
    stats = llm.engine.scheduler.stats
    before = stats.cached_prompt_tokens
    second = llm.generate(prompts(), PARAMS)
    check(name, hf, second)
    assert stats.cached_prompt_tokens - before > 0.5 * sum(map(len, prompts()))
    assert_drained(llm.engine)


def test_chunked_prefill(checkpoint):
    name, path, hf = checkpoint
    llm = make_llm(path, chunked_prefill_size=16, max_num_batched_tokens=32, enable_prefix_cache=False)
    check(name, hf, llm.generate(prompts(), PARAMS))
    assert_drained(llm.engine)


@pytest.mark.parametrize("name,total,active", [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9)])
def test_real_shape_configs(name, total, active):
    """configs/ (dummy weights of the real shapes): the published total and active parameter counts."""
    cfg = load_model_config(str(Path(__file__).resolve().parents[1] / "configs" / name), "dummy")
    shapes = family_for(cfg.architecture).weight_shapes(cfg)
    n = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for k, s in shapes.items() if ".experts." in k)
    assert n == pytest.approx(total, rel=0.01)
    assert n - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts) == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_dummy_weights_of_the_configs_cut_small(name, tmp_path):
    """`--load-format dummy` draws every tensor `weight_shapes` names and the model loads them
    all: the real configs with fewer, smaller layers and experts."""
    d = json.loads((Path(__file__).resolve().parents[1] / "configs" / name / "config.json").read_text())
    d.update(num_hidden_layers=2, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    d["num_experts" if "num_experts" in d else "num_local_experts"] = 16
    (tmp_path / "config.json").write_text(json.dumps(d))
    llm = make_llm(str(tmp_path / "config.json"), load_format="dummy")
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert_drained(llm.engine)
    d["num_experts_per_tok"] = 17
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="num_experts_per_tok: 17 of 16"):
        load_model_config(str(tmp_path / "config.json"), "dummy")
