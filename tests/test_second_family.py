"""A model family added from outside ketch runs through the real engine (issue 14).

tests/toy_family.py declares a tiny causal LM whose KV cache is one latent vector per token and
layer (not K/V per head), with its own config, weights and attention backend; it is registered
with `register_family`, never written into ketch's registry. Here it runs through `Engine` on
the CPU in fp32 (prefix cache on/off, chunked prefill, batched requests, overlap, preemption)
and its greedy tokens and logprobs must equal a full recompute of the same weights without any
KV cache (`reference_greedy`, below). The pool must hold the toy's layout, and every page must
come back once the engine drains. The last test keeps the layers below the registry free of
Llama field names, so the next family needs no edit there either.
"""
from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import assert_drained, collect, drain
from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.models.registry import family_for, load_model_config, register_family
from ketch.sampling.params import SamplingParams
from toy_family import ARCHITECTURE, LATENT, TOY, TOY_HF_CONFIG, LatentAttentionBackend, ToyConfig, save_checkpoint

KETCH = Path(__file__).resolve().parent.parent / "ketch"
CFG = ToyConfig.from_hf(TOY_HF_CONFIG)
MAX_TOKENS = 10
BASE = [5, 17, 33, 8, 61, 22, 90, 14, 3, 47, 71, 26, 58]
PROMPTS = [  # shared prefixes (cache hits across and within waves), one short, one long
    BASE,
    BASE + [40, 41, 42, 43, 44],
    BASE[:9] + [50, 51],
    [7, 9],
    [(i * 37 + 11) % 97 for i in range(29)],
]


@pytest.fixture
def toy_registered() -> Iterator[None]:
    undo = register_family(TOY)
    yield
    undo()


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    d = tmp_path_factory.mktemp("toy_latent")
    return str(d), save_checkpoint(d)


# ---------------------------------------------------------------- the reference: no KV cache at all
def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * w


def reference_logits(w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: every position recomputed from the token ids, K and V up-projected from
    every token's latent, causal softmax attention written out."""
    n, h, d = len(ids), CFG.num_query_heads, CFG.head_size
    x = w["model.embed_tokens.weight"][ids] + w["model.embed_positions.weight"][:n]
    causal = torch.ones(n, n).tril().bool()
    for i in range(CFG.num_layers):
        p = f"model.layers.{i}."
        a = _norm(x, w[p + "attn_norm.weight"])
        latent = a @ w[p + "self_attn.latent_proj.weight"].T  # [n, latent_dim]
        q = (a @ w[p + "self_attn.q_proj.weight"].T).view(n, h, d).transpose(0, 1)
        k = (latent @ w[p + "self_attn.k_up.weight"].T).view(n, h, d).transpose(0, 1)
        v = (latent @ w[p + "self_attn.v_up.weight"].T).view(n, h, d).transpose(0, 1)
        scores = (q @ k.transpose(1, 2) / d**0.5).masked_fill(~causal, float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, h * d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        m = _norm(x, w[p + "mlp_norm.weight"])
        x = x + torch.nn.functional.silu(m @ w[p + "mlp.up.weight"].T) @ w[p + "mlp.down.weight"].T
    return _norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def reference_greedy(w: dict[str, torch.Tensor], prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    ids, out, logprobs = list(prompt), [], []
    for _ in range(max_tokens):
        last = reference_logits(w, ids)[-1].log_softmax(-1)
        tok = int(last.argmax())
        ids.append(tok)
        out.append(tok)
        logprobs.append(float(last[tok]))
    return out, logprobs


@pytest.fixture(scope="module")
def expected(toy_checkpoint) -> list[tuple[list[int], list[float]]]:
    weights = toy_checkpoint[1]
    return [reference_greedy(weights, p, MAX_TOKENS) for p in PROMPTS]


# ---------------------------------------------------------------- through the engine
def toy_engine(path: str, **kw) -> Engine:
    kw.setdefault("kv_cache_memory", 64 * 1024)  # 4-token pages of 2 layers x 6 fp32: 192 B each
    return Engine(EngineConfig(model=path, dtype="float32", device="cpu", page_size=4, **kw))


def run_wave(engine: Engine, tag: str) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """All prompts added before the first step (one batch); ids, logprobs, cached prompt tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", p, params)
    outs = drain(engine)
    res = collect(outs)
    cached = {o.request_id: o.num_cached_tokens for o in outs if o.finished}
    keys = [(f"{tag}{i}", 0) for i in range(len(PROMPTS))]
    return ([res[k]["ids"] for k in keys], [[lp.logprob for lp in res[k]["logprobs"]] for k in keys],
            [cached[k[0]] for k in keys])


def assert_matches(got_ids, got_lps, expected) -> None:
    for i, ((ids, lps), g_ids, g_lps) in enumerate(zip(expected, got_ids, got_lps)):
        assert g_ids == ids, f"prompt {i}: engine {g_ids} != reference {ids}"
        assert g_lps == pytest.approx(lps, abs=1e-4), f"prompt {i}: logprobs"


@pytest.mark.parametrize(("prefix_cache", "budget", "overlap"), [
    (True, 2048, False), (False, 2048, False),  # whole prompts in one step
    (True, 8, False), (False, 8, False),  # chunked prefill: 8 tokens a step, decodes ride along
    (True, 8, True),  # overlap scheduling: placeholders resolved on the device
], ids=["cache", "nocache", "chunked-cache", "chunked-nocache", "chunked-cache-overlap"])
def test_greedy_matches_full_recompute(toy_registered, toy_checkpoint, expected, prefix_cache, budget, overlap):
    engine = toy_engine(toy_checkpoint[0], enable_prefix_cache=prefix_cache, max_num_batched_tokens=budget,
                        overlap_schedule=overlap)
    for wave in ("a", "b"):  # the second wave meets the first one's pages in the prefix cache
        ids, lps, cached = run_wave(engine, wave)
        assert_matches(ids, lps, expected)
        if wave == "b":  # every whole page of each prompt (but its last token) was cached by wave a
            whole = [(len(p) - 1) // 4 * 4 for p in PROMPTS]
            assert cached == whole if prefix_cache else not any(cached), (cached, whole)
    assert engine.scheduler.stats.computed_tokens > 0
    assert_drained(engine)
    engine.close()


def test_preemption_recomputes_the_latent_cache(toy_registered, toy_checkpoint, expected):
    # 16 pages of 4 tokens for five requests of up to 10 pages each: later ones are preempted,
    # their latents dropped and recomputed
    engine = toy_engine(toy_checkpoint[0], kv_cache_memory=16 * 192, max_num_batched_tokens=16)
    assert engine.runner.pool.num_pages == 16
    ids, lps, _ = run_wave(engine, "p")
    assert engine.scheduler.stats.preemptions > 0
    assert_matches(ids, lps, expected)
    assert_drained(engine)
    engine.close()


def test_pool_holds_the_toy_layout(toy_registered, toy_checkpoint):
    engine = toy_engine(toy_checkpoint[0])
    pool, cfg = engine.runner.pool, engine.model_config
    assert isinstance(cfg, ToyConfig) and not hasattr(cfg, "head_dim") and not hasattr(cfg, "num_kv_heads")
    assert pool.spec == TOY.kv_spec(cfg, engine.runner.parallel)
    assert pool.spec.names == (LATENT,) and len(pool.layers) == CFG.num_layers
    for tensors in pool.layers:
        assert set(tensors) == {LATENT}
        assert tensors[LATENT].shape == (pool.num_pages, 4, CFG.latent_dim)
        assert tensors[LATENT].dtype == torch.float32
    assert pool.bytes_per_page == 4 * CFG.num_layers * CFG.latent_dim * 4
    assert pool.num_pages == 64 * 1024 // pool.bytes_per_page
    with pytest.raises(AttributeError, match="declares no 'k'"):
        pool.k
    assert isinstance(engine.runner.attn, LatentAttentionBackend)
    # what a transport would register: one latent buffer per layer, a page of it 4 x latent_dim floats
    exported = engine.kv.export()
    assert [(b.layer, b.name) for b in exported] == [(i, LATENT) for i in range(CFG.num_layers)]
    assert all(b.page_bytes == 4 * CFG.latent_dim * 4 for b in exported)
    engine.close()


def test_register_family_is_undone_and_refuses_clashes(toy_checkpoint):
    with pytest.raises(ValueError, match="unsupported architecture"):
        family_for(ARCHITECTURE)
    undo = register_family(TOY)
    try:
        assert family_for(ARCHITECTURE) is TOY
        assert isinstance(load_model_config(toy_checkpoint[0]), ToyConfig)
        with pytest.raises(ValueError, match="already served"):
            register_family(TOY)
        with pytest.raises(ValueError, match="already served"):  # a built-in name is never replaced
            register_family(dataclasses.replace(TOY, architectures=("LlamaForCausalLM",)))
        assert family_for("LlamaForCausalLM").name == "llama"
    finally:
        undo()
    undo()  # idempotent
    with pytest.raises(ValueError, match="unsupported architecture"):
        family_for(ARCHITECTURE)


# The Llama family's config fields: a module below the registry that reads one of these is
# Llama-shaped, and the next family would have to edit it.
LLAMA_FIELDS = frozenset({"num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size",
                          "q_size", "kv_size", "num_attention_heads", "num_key_value_heads"})


def test_engine_scheduler_cache_runner_read_no_llama_field():
    hits = []
    for package in ("cache", "scheduler", "engine", "runner"):
        for path in sorted((KETCH / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr in LLAMA_FIELDS:
                    hits.append(f"{path.relative_to(KETCH.parent)}:{node.lineno}: .{node.attr}")
    assert not hits, "model-shaped reads below the registry:\n" + "\n".join(hits)
