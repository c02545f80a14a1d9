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
Shapes: a decode step of n rows runs the graph of the smallest size >= n (1, 2, 4, ..., the
cap; graph_runner.py's sizes), so at most log2(cap) + 1 graphs exist, each compiled on first use
and kept in inductor's FX graph cache across runs. Padded rows repeat row 0's token and
position through the dense math only: attention sees the step's own metadata
(`init_metadata`, exact page widths, as the eager step) and the first n rows; the padded rows'
attention output is zeros. (GraphRunner's static buffers, whose page width is a power of two
and whose mask is rebuilt every step, cost more than the compile saved at bs1.)
After a size's first step its guards are skipped (`skip_guard_eval_unsafe`: only the input
shapes pick the graph; the parameters never change), ~1 ms a step on a 2-vCPU VM.

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

import numpy as np
import torch

from ketch.attention.base import AttentionBackend
from ketch.forward_batch import ForwardBatch, StepKind
from ketch.host_copy import to_device
from ketch.runner.future_tokens import FutureTokens
from ketch.runner.graph_runner import bucket

# (attention backend, its metadata, the step's real rows) of the step being run: set only
# around a compiled call
_STEP: list[Any] = []
CPU_COMPILE_MAX_BS = 32  # largest padded decode batch compiled (6 graphs: 1, 2, 4, 8, 16, 32)

# a plain dispatcher op (torch.library.custom_op's Python wrapper costs more per call)
_LIB = torch.library.Library("ketch_cpu", "DEF")
_LIB.define("decode_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The backend's forward, eager (stores k/v in the pool, attends over the step's pages), for
    the step's real rows. Its pool writes are invisible to the graph; every layer's output feeds
    the next layer, so the calls run in order, once each."""
    attn, meta, n = _STEP
    if q.shape[0] == n:
        return attn.forward(q, k, v, layer, meta)
    out = q.new_zeros(q.shape)
    out[:n] = attn.forward(q[:n], k[:n], v[:n], layer, meta)
    return out


_LIB.impl("decode_attention", _decode_attention, "CPU")
torch.library.register_fake("ketch_cpu::decode_attention", lambda q, k, v, layer: torch.empty_like(q), lib=_LIB)


class _OpAttention:
    """What the traced model sees as its attention backend: the op."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: Any,
                stored: bool = False) -> torch.Tensor:
        return torch.ops.ketch_cpu.decode_attention(q, k, v, layer)  # stored: never (no kv_sink)

    def kv_sink(self, layer: int, meta: Any) -> None:
        return None  # the op stores k and v


class CompiledCPUDecode:
    """Decode-only steps of <= max_bs rows through the compiled forward; the runner asks
    `can_run(batch)` / `run(batch)` as it asks GraphRunner on CUDA."""

    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, max_bs: int, device: torch.device,
                 future: FutureTokens) -> None:
        import torch._dynamo
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True  # round like eager bf16 (module docstring)
        inductor_config.fx_graph_cache = True
        # one graph per padded size; the default limit (8) would drop to eager past 8 sizes
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, max_bs.bit_length() + 2)
        self.model, self.attn, self.device, self.future = model, attn, device, future
        self.max_bs = max_bs
        self._attention = _OpAttention()
        self._compiled = torch.compile(self._forward, dynamic=False, fullgraph=True)
        self._warm: set[int] = set()  # sizes whose graph exists: their guards are skipped

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(ids, positions, self._attention, None)

    def size_for(self, n: int) -> int:
        return min(bucket(n), self.max_bs)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.kind is StepKind.DECODE and batch.num_seqs <= self.max_bs

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, vocab] fp32 and final hidden states [n, H] of a decode-only step of n =
        batch.num_seqs rows that `can_run` (as GraphRunner.run)."""
        n = batch.num_seqs
        bs = self.size_for(n)
        meta = self.attn.init_metadata(batch)
        rows = np.concatenate((np.arange(n), np.zeros(bs - n, np.int64)))  # padded rows: row 0's
        host = to_device(np.concatenate((batch.input_ids[rows], batch.positions[rows])), self.device)
        ids = self.future.resolve(host[:bs])
        _STEP[:] = (self.attn, meta, n)
        try:
            if bs in self._warm:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    hidden = self._compiled(ids, host[bs:])
            else:
                hidden = self._compiled(ids, host[bs:])
                self._warm.add(bs)
        finally:
            _STEP.clear()
        return self.model.compute_logits(hidden[:n]), hidden[:n]
