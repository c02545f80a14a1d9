"""CPU decode steps as one inductor-compiled graph per padded batch size (EngineConfig.cpu_compile).

An eager CPU decode step is ~1,000 small aten ops (norms, RoPE, SiLU·mul, residual adds,
views), each paying Python + dispatcher time. Here the whole decode forward (embedding → 30
layers → final norm) is compiled once per batch-size bucket by torch.compile's C++ backend
with static shapes (dynamic=False, fullgraph=True): the elementwise/norm/RoPE/residual work
around the matmuls fuses into a few loops per layer. What inductor must not look into:
    - the 4-bit matmul: aten's `_weight_int4pack_mm_for_cpu`, already an opaque extern call;
    - paged attention: `ketch::cpu_decode_attention`, a custom op (below) that calls the
      attention backend eagerly (KV store, page gather, SDPA). The step's metadata never
      enters the graph: the op finds it in `_STEP`, set around each call, so the page-table
      width (which grows with the context) never recompiles anything.
Shapes: the runner reuses GraphRunner (graph_runner.py) on the CPU: a step of n rows runs the
static-buffer forward of the smallest size >= n (1, 2, 4, ..., the cap), padded rows repeat
row 0 (ketch/attention/torch_backend.py), so at most log2(cap) + 1 graphs exist, each compiled
on first use and kept in inductor's FX graph cache across runs.

Numerics: `emulate_precision_casts` makes the fused bf16 loops round where eager rounds (the
RMSNorm rounding before the weight multiply matters on SmolLM2: ketch/layers/norm.py), so a
compiled step's logits equal the eager step's bit for bit on the bundled model (tests).

Why the old per-layer-block attempt ran ~2x slower than eager: each compiled region costs a
guard check plus the AOT/inductor wrapper (~0.1-0.3 ms on a 2-vCPU VM), and 60 regions a step
cost more than the small ops they replaced; `dynamic=True` added symbolic-size bookkeeping on
top. One region per step pays that once.
"""
from __future__ import annotations

from typing import Any

import torch

# (attention backend, its metadata) of the step being run: set only around a compiled call
_STEP: list[Any] = []
CPU_COMPILE_MAX_BS = 32  # largest padded decode batch compiled (6 graphs: 1, 2, 4, 8, 16, 32)


@torch.library.custom_op("ketch::cpu_decode_attention", mutates_args=())
def cpu_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The backend's forward, eager (stores k/v in the pool, attends over the step's pages).
    Its pool writes are invisible to the graph; every layer's output feeds the next layer, so
    the calls run in order, once each."""
    attn, meta = _STEP
    return attn.forward(q, k, v, layer, meta)


@cpu_decode_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


class _OpAttention:
    """What the traced model sees as its attention backend: the custom op."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: Any) -> torch.Tensor:
        return torch.ops.ketch.cpu_decode_attention(q, k, v, layer)


class CompiledDecodeModel:
    """Stands in for the model in GraphRunner's CPU decode path: same call, compiled inside."""

    def __init__(self, model: torch.nn.Module, max_bs: int) -> None:
        import torch._dynamo
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True  # round like eager bf16 (module docstring)
        inductor_config.fx_graph_cache = True
        # one graph per padded size; the default limit (8) would drop to eager past 8 sizes
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, max_bs.bit_length() + 2)
        self.model = model
        self._attention = _OpAttention()
        self._compiled = torch.compile(self._forward, dynamic=False, fullgraph=True)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(ids, positions, self._attention, None)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, attn: Any, meta: Any) -> torch.Tensor:
        _STEP[:] = (attn, meta)
        try:
            return self._compiled(ids, positions)
        finally:
            _STEP.clear()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
