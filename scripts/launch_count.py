"""What one decode step launches on the Triton layer ops, counted on the CPU (no GPU needed).

A model's config from configs/ is cut to two small layers (the first dense where the family has
dense layers, the second sparse) with dummy weights, and run on the Triton attention backend and
layer kernels in Triton's CPU interpreter. After a few warm-up steps one decode step is counted:
the Triton kernels it launches (by name) and the torch ops that would be kernels on a GPU (views
and allocations left out). On the CPU the dense products are torch `linear` ops; on CUDA the
decode-sized ones are the gemv kernel, one launch each.

    python scripts/launch_count.py deepseek-v2-lite qwen3-30b-a3b
    PYTHONPATH=.base python scripts/launch_count.py deepseek-v2-lite      # an older tree's

At batch 1 each launch costs a ramp and a tail (docs/performance.md, issue 19): this is the
count to compare before and after a fusion, the H200 A/B (scripts/h200_ab.sh) the time.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from ketch.config import EngineConfig  # noqa: E402
from ketch.engine.engine import Engine  # noqa: E402
from ketch.sampling.params import SamplingParams  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SMALL = dict(num_hidden_layers=2, first_k_dense_replace=1, hidden_size=64, intermediate_size=96,
             moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             num_experts=8, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
NOT_KERNELS = ("empty", "view", "slice", "select", "as_strided", "reshape", "t.", "transpose", "unsqueeze", "squeeze",
               "expand", "detach", "alias", "_reshape_alias", "split", "narrow", "permute", "unbind", "_unsafe_view",
               "new_empty", "lift_fresh", "flatten", "to.", "_to_copy")  # views, allocations, same-dtype casts


def small_config(name: str, into: Path) -> str:
    d = json.loads((CONFIGS / name / "config.json").read_text())
    d.update(SMALL)
    if "deepseek" in d.get("model_type", name):
        d["num_key_value_heads"] = d["num_attention_heads"]  # MLA: one latent, heads = kv heads in HF's config
        if d.get("q_lora_rank"):
            d["q_lora_rank"] = 48
    (into / "config.json").write_text(json.dumps(d))
    return str(into / "config.json")


def count_step(config: str) -> tuple[collections.Counter, collections.Counter]:
    engine = Engine(EngineConfig(model=config, load_format="dummy", dtype="float32", device="cpu",
                                 attention_backend="triton", layer_kernels="triton", cuda_graph=False,
                                 overlap_schedule=False, kv_cache_memory=2 << 20, page_size=4), ())
    engine.add_request("a", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(3):  # prefill, then decode steps: the counted one is a decode step like them
        engine.step()
    launches: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    launch = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN202
        launches[self.fn.__name__] += 1
        return launch(self, *args, **kwargs)

    class TorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201
            inside_a_kernel = any("triton/runtime/interpreter" in f.filename for f in traceback.extract_stack())
            if not inside_a_kernel and not func.__name__.startswith(NOT_KERNELS):
                ops[func.__name__] += 1
            return func(*args, **(kwargs or {}))

    interpreter.GridExecutor.__call__ = counted
    try:
        with TorchOps():
            engine.step()
    finally:
        interpreter.GridExecutor.__call__ = launch
    return launches, ops


def main() -> None:
    names = sys.argv[1:] or ["deepseek-v2-lite", "qwen3-30b-a3b"]
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            launches, ops = count_step(small_config(name, Path(tmp)))
        print(f"{name} (2 small layers; decode step): {sum(launches.values())} Triton launches, "
              f"{sum(ops.values())} torch kernels")
        for kernel, n in sorted(launches.items()):
            print(f"  triton  {n:3d}  {kernel}")
        for op, n in sorted(ops.items()):
            print(f"  torch   {n:3d}  {op}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
