"""Repetition penalty end to end: ketch's greedy ids against HF `generate(repetition_penalty=r)` on a
tiny random Llama in fp32. HF's RepetitionPenaltyLogitsProcessor is the reference: every token seen
in prompt + output has its logit l made l / r if l > 0 else l * r.

The prompts are checked to be ones where the prompt's share of the penalty decides tokens: HF with
the same penalty over the output alone gives other ids for some of them, so an engine whose penalty
forgets the prompt fails here (the unit test of the formula does not run the engine)."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_drained, collect, drain
from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams

NEW_TOKENS = 24
PENALTIES = [1.3, 0.7]  # discouraging and encouraging repeats


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, str]:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.3,
        eos_token_id=299, bos_token_id=1,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("penalty_llama")
    hf.save_pretrained(path)
    return hf, str(path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 299) for _ in range(n)] for n in (6, 13, 21, 40)]


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], **kw) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def _output_only(prompt_len: int, penalty: float):
    """HF's own penalty processor, shown only the generated ids (what a prompt-blind engine does)."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    inner = RepetitionPenaltyLogitsProcessor(penalty)

    def process(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return inner(ids[:, prompt_len:], scores) if ids.shape[1] > prompt_len else scores

    return LogitsProcessorList([process])


@pytest.fixture(scope="module")
def reference(checkpoint, prompts) -> dict[float | None, list[list[int]]]:
    """HF greedy ids per prompt: None without a penalty, else with repetition_penalty=r."""
    hf, _ = checkpoint
    refs: dict[float | None, list[list[int]]] = {None: [_hf_greedy(hf, p) for p in prompts]}
    for r in PENALTIES:
        refs[r] = [_hf_greedy(hf, p, repetition_penalty=r) for p in prompts]
        blind = [_hf_greedy(hf, p, logits_processor=_output_only(len(p), r)) for p in prompts]
        # the inputs must be able to tell: some prompt's penalty changes a token, and the penalty acts
        assert any(a != b for a, b in zip(refs[r], blind, strict=True)), f"the prompt's share decides nothing at {r}"
        assert all(a != b for a, b in zip(refs[r], refs[None], strict=True)), f"the penalty changes nothing at {r}"
    return refs


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("penalty", PENALTIES)
def test_repetition_penalty_matches_hf(checkpoint, prompts, reference, penalty, overlap):
    """Penalized and plain rows in one batch, twice: the second pass admits each prompt through a
    prefix-cache hit, and the penalty must still see the whole prompt."""
    _, path = checkpoint
    engine = Engine(EngineConfig(model=path, dtype="float32", kv_cache_memory=4 << 20, page_size=4,
                                 overlap_schedule=overlap))
    penalized = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=penalty)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for rnd in range(2):
        for i, p in enumerate(prompts):
            engine.add_request(f"{rnd}-pen-{i}", p, penalized)
            engine.add_request(f"{rnd}-plain-{i}", p, plain)
        res = collect(drain(engine))
        got = [res[(f"{rnd}-pen-{i}", 0)]["ids"] for i in range(len(prompts))]
        for i, (ids, ref) in enumerate(zip(got, reference[penalty], strict=True)):
            assert ids == ref, f"round {rnd}, prompt {i}, repetition_penalty={penalty}"
        assert [res[(f"{rnd}-plain-{i}", 0)]["ids"] for i in range(len(prompts))] == reference[None]
    assert engine.scheduler.stats.cached_prompt_tokens > 0  # the second round did hit the cache
    assert_drained(engine)
