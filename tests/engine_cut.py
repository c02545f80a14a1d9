"""A config of configs/ cut to two small layers (dummy weights, fp32), and one prompt through it at
batch 1 on the torch path and on the Triton kernels (the interpreter without CUDA), with one kernel
wrapper watched: each call's row count recorded, the call itself made as usual."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = dict(num_hidden_layers=2, first_k_dense_replace=1, hidden_size=64, intermediate_size=96,
             moe_intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             num_experts=8, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
PROMPT = [5, 9, 11, 40, 2]


def cut_config(name: str, folder: Path, **overrides: int) -> str:
    d = {**json.loads((CONFIGS / name / "config.json").read_text()), **SMALL, **overrides}
    if name.startswith("deepseek"):  # MLA: the latent expands into every query head
        d["num_key_value_heads"] = d["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(d))
    return str(folder / "config.json")


def batch_one_on_both_paths(path: str, device: str, module: ModuleType, name: str, max_tokens: int):
    """((ids, logprobs) of the torch path, (ids, logprobs) of the Triton one, rows per call of
    module.name during the Triton run). Eager steps (no CUDA graphs), so every call is seen."""
    from conftest import greedy_ids_and_logprobs, make_tiny_engine

    reference = make_tiny_engine(path, device=device, attention_backend="torch", layer_kernels="torch",
                                 cuda_graph=False)
    want = greedy_ids_and_logprobs(reference, [PROMPT], max_tokens)
    engine = make_tiny_engine(path, device=device, attention_backend="triton", layer_kernels="triton",
                              cuda_graph=False)
    rows: list[int] = []
    real: Callable = getattr(module, name)

    def watched(x, *args, **kwargs):
        rows.append(x.shape[0])
        return real(x, *args, **kwargs)

    setattr(module, name, watched)  # watched, not replaced: it still computes
    try:
        got = greedy_ids_and_logprobs(engine, [PROMPT], max_tokens)
    finally:
        setattr(module, name, real)
    engine.check_invariants()
    return want, got, rows


def assert_same_tokens(want, got, tolerance: float = 1e-4) -> None:
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1][0], want[1][0], strict=True)) < tolerance
