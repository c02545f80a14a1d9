"""EngineConfig.cpu_compile (ketch/runner/cpu_compile.py): CPU decode steps through one compiled
graph per padded batch size give the eager steps' greedy tokens; padded sizes; the switch is
CPU-only and chosen at init."""
from __future__ import annotations

import pytest

from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.runner.cpu_compile import CompiledCPUDecode
from ketch.sampling.params import SamplingParams
from conftest import drain, make_tiny_engine


def _greedy(engine: Engine, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {}
    for o in drain(engine):
        out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_tiny_model_padded_batches_match_eager(tiny_config_path):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(3)]  # 3 rows: padded to 4
    eager = _greedy(make_tiny_engine(tiny_config_path), prompts, 12)
    engine = make_tiny_engine(tiny_config_path, cpu_compile=True)
    assert isinstance(engine.runner.graphs, CompiledCPUDecode)
    assert _greedy(engine, prompts, 12) == eager
    assert _greedy(engine, prompts[:1], 6) == _greedy(make_tiny_engine(tiny_config_path), prompts[:1], 6)


# One bf16 step (8 significant bits) of a logit up to 64 in magnitude: two logits this close are a
# tie that bf16 logits cannot order (the margin seen on an AMD EPYC VM was 0.125: one step at 16-32)
BF16_LOGIT_STEP = 0.25


def _greedy_top2(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[float], list[dict[int, float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=2)
    engine.add_request("r", prompt, params)
    lps = [lp for o in drain(engine) for lp in o.new_logprobs or []]
    return [lp.token_id for lp in lps], [lp.logprob for lp in lps], [dict(lp.top) for lp in lps]


def test_bundled_model_bf16_decode_matches_eager(smollm_path, monkeypatch):
    """The default CPU fast path (bf16 activations, 4-bit GGUF matmuls): the same greedy tokens,
    but where the two paths' own bf16 difference can decide. A compiled graph fuses ops, so its
    bf16 roundings are not eager's: a near-tie may fall the other way (bit equality is the fp32
    promise, test_tiny_model_padded_batches_match_eager). So: the same tokens up to the first
    difference, if any, and there the compiled pick is eager's runner-up by a margin no larger than
    one bf16 step of the logits (they are bf16 on this path) plus twice the largest logprob
    difference the two paths showed on the tokens before it (each of the two logits moved by it). Both take torch's layer ops (a compiled engine does:
    EngineConfig.resolved_layer_kernels). The 4-bit crossover is pinned: measured, it moves between
    8 and 16 tokens from run to run on a small VM, which picks the 4-bit or the dense product."""
    monkeypatch.setenv("KETCH_INT4_CROSSOVER", "8")
    prompt = [1, 504, 3458, 282, 4372, 314, 253, 3527, 30]
    kw = dict(model=smollm_path, dtype="bfloat16", kv_cache_memory=64 << 20, max_num_seqs=4, layer_kernels="torch")
    ids, lps, tops = _greedy_top2(Engine(EngineConfig(**kw)), prompt, 16)
    got, got_lps, _ = _greedy_top2(Engine(EngineConfig(cpu_compile=True, **kw)), prompt, 16)
    same = next((i for i, (a, b) in enumerate(zip(ids, got, strict=True)) if a != b), len(ids))
    if same == len(ids):
        return
    noise = max((abs(a - b) for a, b in zip(lps[:same], got_lps[:same])), default=0.0)
    assert got[same] in tops[same], (same, ids, got)  # eager's runner-up
    assert tops[same][ids[same]] - tops[same][got[same]] <= BF16_LOGIT_STEP + 2 * noise, (same, tops[same], noise)


def test_cpu_compile_refuses_cuda(tiny_config_path):
    from ketch.runner.model_runner import ModelRunner

    cfg = EngineConfig(model=tiny_config_path, load_format="dummy", device="cuda:0", cpu_compile=True)
    with pytest.raises(ValueError, match="cpu_compile"):
        ModelRunner(cfg, None, 64)  # refused before the model is read


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "qwen3-30b-a3b"])
def test_cpu_compile_refuses_moe_and_mla_models_by_name(name, tmp_path):
    """A mixture-of-experts or MLA model cannot be traced (the experts' routing syncs with the
    host; MLA attention has another call shape): --cpu-compile is refused at start-up, naming
    the flag, instead of failing at the first decode step."""
    import json
    from pathlib import Path

    d = json.loads((Path(__file__).resolve().parents[1] / "configs" / name / "config.json").read_text())
    d.update(num_hidden_layers=1, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, vocab_size=512,
             num_attention_heads=4, num_key_value_heads=4, head_dim=16, kv_lora_rank=32, qk_rope_head_dim=16,
             qk_nope_head_dim=32, v_head_dim=32, num_experts=8, n_routed_experts=8, first_k_dense_replace=0)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="cpu_compile: .* eagerly"):
        make_tiny_engine(str(tmp_path / "config.json"), cpu_compile=True)
    make_tiny_engine(str(tmp_path / "config.json"))  # the same model runs without it
