"""Running ketch and HF transformers for the GPU parity tests (tests/test_gpu.py): Llama-3.1-8B
configs cut to fewer layers, engines of dummy weights, random prompts (half with a shared prefix),
greedy runs that keep every step's fp32 logits, and HF's LlamaForCausalLM on the same tensors."""
from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import random
from pathlib import Path

import torch
from conftest import collect, drain
from logit_tap import LogitTap

from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.models import weight_shapes
from ketch.sampling.params import SamplingParams
from ketch.weights.dummy_loader import DummyWeights

LLAMA_8B = Path(__file__).resolve().parents[1] / "configs" / "llama-3.1-8b" / "config.json"
DEVICE = "cuda"
NUM_PROMPTS = 16
NEW_TOKENS = 32


@dataclasses.dataclass
class Run:
    """One side of a comparison: per prompt, the greedy tokens and each step's fp32 logits."""

    tokens: list[list[int]]
    logits: list[list[torch.Tensor]]  # [prompt][step] -> [vocab] fp32


def sliced_config(tmp_path: Path, layers: int) -> str:
    d = json.loads(LLAMA_8B.read_text())
    d["num_hidden_layers"] = layers
    path = tmp_path / f"llama-3.1-8b-{layers}l.json"
    path.write_text(json.dumps(d))
    return str(path)


def make_engine(config_path: str, dtype: str, **kw) -> Engine:
    kw.setdefault("kv_cache_memory", 2 << 30)
    kw.setdefault("cuda_graph_max_bs", NUM_PROMPTS)  # captures 1, 2, 4, 8, 16: all this test decodes
    return Engine(EngineConfig(model=config_path, load_format="dummy", dtype=dtype, device=DEVICE,
                               max_model_len=1024, seed=0, **kw))


def make_prompts(vocab: int) -> list[list[int]]:
    """Random prompts; every other one starts with a shared 40-token prefix (2 full pages of 16),
    so a second pass over them hits the prefix cache."""
    rng = random.Random(1234)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = []
    for i in range(NUM_PROMPTS):
        own = [rng.randrange(vocab) for _ in range(rng.randint(8, 56))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def engine_greedy(engine: Engine, prompts: list[list[int]], batched: bool, tag: str) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    groups = [range(len(prompts))] if batched else [[i] for i in range(len(prompts))]
    outs = []
    with LogitTap(engine) as tap:
        for group in groups:
            for i in group:
                engine.add_request(f"{tag}-{i}", prompts[i], params)
            outs += drain(engine)
    res = collect(outs)
    return Run([res[(f"{tag}-{i}", 0)]["ids"] for i in range(len(prompts))],
               [tap.rows[f"{tag}-{i}"] for i in range(len(prompts))])


def build_hf(config_path: str, engine: Engine, device: str, dtype: torch.dtype | None = None):
    """HF LlamaForCausalLM of the same config holding the same dummy tensors (same seed and device),
    in the engine's dtype or in `dtype` (the engine's tensors cast exactly, e.g. bf16 → fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**json.loads(Path(config_path).read_text()))
    dtype = dtype or engine.runner.dtype
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(saved)
    weights = DummyWeights(weight_shapes(engine.model_config), engine.runner.dtype, seed=engine.config.seed, device=device)
    # tensor by tensor into HF's own parameters: a whole state dict beside both models (the full
    # 8B cast to fp32 is 32 GB more) does not fit an 80 GB card
    state = hf.state_dict()
    loaded = set()
    with torch.no_grad():
        for name, t in weights:
            state[name].copy_(t)  # exact: the engine's dtype cast up (or the same dtype)
            loaded.add(name)
    assert loaded == set(state), f"weights without a tensor: {sorted(set(state) - loaded)[:5]}"
    ours = engine.runner.model
    assert torch.equal(hf.model.embed_tokens.weight.to(ours.embed_tokens.weight.dtype), ours.embed_tokens.weight)
    assert torch.equal(hf.lm_head.weight.to(ours.lm_head.weight.dtype), ours.lm_head.weight)
    q = hf.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q.to(ours.embed_tokens.weight.dtype), ours.layers[0].self_attn.qkv_proj.weight[: q.shape[0]])
    return hf.eval()


@torch.inference_mode()
def hf_greedy(hf, prompts: list[list[int]], device: str) -> Run:
    from transformers import DynamicCache

    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    tokens, logits = [], []
    for prompt in prompts:
        cache = DynamicCache()
        ids = torch.tensor([prompt], device=device)
        toks: list[int] = []
        steps: list[torch.Tensor] = []
        for _ in range(NEW_TOKENS):
            out = hf(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
            row = out.logits[0, -1].float()
            steps.append(row)
            toks.append(int(row.argmax()))
            ids = torch.tensor([[toks[-1]]], device=device)
        tokens.append(toks)
        logits.append(steps)
    return Run(tokens, logits)


def release() -> None:
    gc.collect()  # engines hold reference cycles (graph runners, patched methods): free them now
    torch.cuda.empty_cache()
