"""The bundled SmolLM2-135M (fp32) at tensor parallel size 2 gives TP=1's greedy token ids for
test_parity.py's 20 prompts. Its 9 heads / 3 kv heads do not split evenly over 2 ranks: rank 0
holds kv heads 0-1 with q heads 0-5, rank 1 kv head 2 with q heads 6-8 (head_share)."""
from __future__ import annotations

import torch

from ketch.llm import LLM
from ketch.sampling.params import SamplingParams
from test_parity import PROMPTS

NEW_TOKENS = 32


def greedy(smollm_path: str, tp: int) -> list[list[int]]:
    threads = torch.get_num_threads()  # two ranks on a small shared box: one thread each, given back
    llm = LLM(smollm_path, dtype="float32", num_threads=1, tensor_parallel_size=tp)
    try:
        prompts = [llm.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        return [out.token_ids for out in llm.generate(prompts, params)]
    finally:
        llm.close()
        torch.set_num_threads(threads)


def test_smollm2_tp2_greedy_ids_equal_tp1(smollm_path):
    ref = greedy(smollm_path, 1)
    assert len(ref) == 20 and all(len(ids) == NEW_TOKENS for ids in ref)
    got = greedy(smollm_path, 2)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a == b, f"prompt {i}: {PROMPTS[i]!r}"
