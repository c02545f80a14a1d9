"""The DeepSeek-V2/V3 family (MLA over a latent KV pool; dense and MoE layers) against HF transformers.

Tiny random checkpoints are built here with transformers' own classes (`from_config` +
`save_pretrained`) and served by in-process `ketch.LLM` in fp32 on the CPU: 16 prompts x 32
greedy tokens must be HF's greedy ids, chosen-token logprobs within 1e-4 (`check`: one
teacher-forced HF forward per run, plus HF `generate` on two prompts). Checkpoints:

    v2-lite   DeepseekV2, no q LoRA (plain q_proj), YaRN with mscale != mscale_all_dim (both the
              rope factor and the softmax mscale^2 differ from 1), complex (interleaved) RoPE
    v3        DeepseekV3, q LoRA, YaRN as above, interleaved rope, 3 layers
    v3-neox   DeepseekV3, rope_interleave=False (rotate-half layout), plain RoPE, attention biases
    v2-moe    DeepseekV2, layers 1-2 MoE (ketch/models/deepseek_moe.py): 8 routed experts, top-3,
              1 shared; softmax, group_limited_greedy (4 groups, 2 kept), routed_scaling_factor 2,
              norm_topk_prob true in config.json (which HF's V2 ignores)
    v3-moe    DeepseekV3, layers 1-2 MoE: 8 routed experts, top-2, 1 shared; sigmoid, noaux_tc
              (4 groups, 2 kept) with a random (non-zero) e_score_correction_bias,
              norm_topk_prob, routed_scaling_factor 2.5

Prefill and extend chunks run MLA in the expanded form, decode rows in the absorbed form
(ketch/attention/mla_backend.py), so every run below checks both against HF; prefix-cache hits,
chunked prefill, preemption and overlap scheduling only move pages and must change nothing.
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_drained
from ketch.llm import LLM
from ketch.models.deepseek_family import LATENT, DeepseekConfig
from ketch.sampling.params import SamplingParams
from ketch.weights.source import default_model_path

NEW_TOKENS, PAGE = 32, 8
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.9}
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.3,
            eos_token_id=299, bos_token_id=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
           n_shared_experts=1, n_group=4, topk_group=2, rope_parameters=YARN)
CHECKPOINTS = {  # dense: first_k_dense_replace = num_hidden_layers
    # attention_bias: kv_a has a bias, q_proj (no q LoRA) has none (HF): one stacked product, one biased part
    "v2-lite": ("DeepseekV2Config", dict(q_lora_rank=None, first_k_dense_replace=2, rope_parameters=YARN,
                                         attention_bias=True)),
    "v3": ("DeepseekV3Config", dict(num_hidden_layers=3, first_k_dense_replace=3, rope_parameters=YARN)),
    "v3-neox": ("DeepseekV3Config", dict(first_k_dense_replace=2, rope_interleave=False, attention_bias=True,
                                         rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    # top-3: with k <= topk_group, group_limited_greedy picks what plain greedy picks (the k best
    # experts' groups are always among the k best groups by their best expert)
    # norm_topk_prob: HF's V2 router never reads it (nor may we)
    "v2-moe": ("DeepseekV2Config", dict(MOE, num_experts_per_tok=3, topk_method="group_limited_greedy",
                                        routed_scaling_factor=2.0, norm_topk_prob=True)),
    "v3-moe": ("DeepseekV3Config", dict(MOE, norm_topk_prob=True, routed_scaling_factor=2.5)),
}
LIGHT = "v3-neox"  # a rope-layout variant: no chunked/preemption run (CI time)
FULL = sorted(set(CHECKPOINTS) - {LIGHT})  # every path
_rng = random.Random(7)
_SHARED = [_rng.randrange(3, 299) for _ in range(24)]
# 16 prompts of 10..40 tokens; most share a prefix of 8..24 tokens (page hits on a second pass)
PROMPTS = [_SHARED[: 8 + (i * 5) % 17] + [_rng.randrange(3, 299) for _ in range(2 + (i * 7) % 17)] for i in range(12)]
PROMPTS += [[_rng.randrange(3, 299) for _ in range(10 + 9 * i)] for i in range(4)]
GENERATED = (0, 15)  # also checked against HF `generate` token by token
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops run fastest on one thread (CI has two cores); given back at module teardown."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_BUILT: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """(name, path, HF model, HF `generate`'s greedy ids for GENERATED prompts)."""
    return build(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=FULL)
def full_checkpoint(request, tmp_path_factory):
    """`checkpoint` without the rope-layout variant (LIGHT): for the layout-independent paths."""
    return build(request.param, tmp_path_factory)


def build(name: str, tmp_path_factory) -> tuple:
    """Each checkpoint once per module, whichever fixture asks first."""
    if name not in _BUILT:
        _BUILT[name] = _build(name, tmp_path_factory)
    return _BUILT[name]


def _build(name: str, tmp_path_factory) -> tuple:
    import transformers

    cls_name, extra = CHECKPOINTS[name]
    cfg = getattr(transformers, cls_name)(**{**BASE, **extra})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    for layer in hf.model.layers:  # V3 MoE: HF initialises the correction bias to 0; make it matter
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.rand(bias.shape, generator=torch.Generator().manual_seed(1)) - 0.5)
    for module in hf.modules():  # attention_bias: HF initialises the biases to 0; make them matter too
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            module.bias.data.normal_(0, 0.2, generator=torch.Generator().manual_seed(2))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    generated = {}
    with torch.inference_mode():
        for i in GENERATED:
            out = hf.generate(torch.tensor([PROMPTS[i]]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
            generated[i] = out[0, len(PROMPTS[i]):].tolist()
    return name, str(path), hf, generated


def make_llm(path: str, **kw) -> LLM:
    # the checkpoint has no tokenizer: the bundled one (prompts are token ids anyway)
    kw.setdefault("kv_cache_memory", 4 << 20)
    return LLM(path, tokenizer=default_model_path(), dtype="float32", page_size=PAGE, **kw)


def check(outputs, checkpoint) -> None:
    """Every token ketch chose is the argmax of HF's logits over the prompt and ketch's tokens
    before it (one teacher-forced HF forward of all sequences, right-padded: causal attention
    never sees the padding), which by induction is HF's greedy sequence; its logprob within 1e-4
    of HF's. And HF `generate` itself agrees on GENERATED prompts (its KV-cache path)."""
    name, _, hf, generated = checkpoint
    seqs = [p + out.token_ids for p, out in zip(PROMPTS, outputs, strict=True)]
    width = max(map(len, seqs))
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([s + [0] * (width - len(s)) for s in seqs]), use_cache=False).logits
    for i, (p, out) in enumerate(zip(PROMPTS, outputs)):
        ref = logits[i, len(p) - 1 : len(p) - 1 + NEW_TOKENS].log_softmax(-1)  # predicts each new token
        assert len(out.token_ids) == NEW_TOKENS
        assert out.token_ids == ref.argmax(-1).tolist(), f"{name}: prompt {i} diverges from HF"
        want = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert (got - want).abs().max() < 1e-4, f"{name}: prompt {i} logprobs"
    for i, ids in generated.items():
        assert outputs[i].token_ids == ids, f"{name}: prompt {i} differs from HF generate"


def test_greedy_matches_hf_then_hits_the_prefix_cache(checkpoint):
    llm = make_llm(checkpoint[1])
    first = llm.generate(PROMPTS, PARAMS)
    check(first, checkpoint)
    second = llm.generate(PROMPTS, PARAMS)  # every whole page of each prompt is cached now
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // PAGE * PAGE for p in PROMPTS]
    check(second, checkpoint)
    assert_drained(llm.engine)


def test_chunked_prefill_and_preemption_with_overlap(full_checkpoint):
    checkpoint = full_checkpoint
    _, path, hf, _ = checkpoint
    cfg = hf.config
    page_bytes = PAGE * cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    longest = -(-(max(map(len, PROMPTS)) + NEW_TOKENS) // PAGE)
    llm = make_llm(path, kv_cache_memory=3 * longest * page_bytes, chunked_prefill_size=16,
                   max_num_batched_tokens=32, overlap_schedule=True)  # tokens processed one step late
    assert llm.engine.overlap
    assert llm.engine.runner.pool.num_pages == 3 * longest  # room for about three requests at a time
    check(llm.generate(PROMPTS, PARAMS), checkpoint)
    assert llm.engine.scheduler.stats.preemptions > 0
    assert_drained(llm.engine)


def test_pool_holds_one_latent_per_layer(checkpoint):
    _, path, hf, _ = checkpoint
    cfg = hf.config
    llm = make_llm(path, kv_cache_memory=1 << 20)
    pool = llm.engine.runner.pool
    assert pool.spec.names == (LATENT,) and len(pool.layers) == cfg.num_hidden_layers
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert all(t[LATENT].shape == (pool.num_pages, PAGE, width) for t in pool.layers)
    assert pool.bytes_per_page == PAGE * cfg.num_hidden_layers * width * 4
    assert isinstance(llm.engine.model_config, DeepseekConfig)


def test_weight_shapes_are_the_saved_checkpoint(checkpoint):
    """The family's `weight_shapes` names exactly the tensors HF's `save_pretrained` wrote, with
    their shapes: each routed expert's projections, the router (and V3's correction bias), the
    shared experts."""
    from safetensors import safe_open

    from ketch.models.deepseek_family import DEEPSEEK
    from ketch.models.registry import load_model_config

    name, path, _, _ = checkpoint
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert DEEPSEEK.weight_shapes(load_model_config(path)) == saved
    moe = {k for k in saved if ".mlp.experts." in k or ".shared_experts." in k or ".mlp.gate." in k}
    assert bool(moe) == name.endswith("-moe")
    assert any(k.endswith("gate.e_score_correction_bias") for k in moe) == (name == "v3-moe")
