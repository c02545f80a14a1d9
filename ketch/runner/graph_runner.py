"""One CUDA-graph runner for decode-only steps, whatever the attention backend (EngineConfig.cuda_graph).

An eager 8B decode step launches ~1,000 small kernels, and at batch 1 the host cannot issue
them as fast as the GPU runs them. A graph replays the whole forward (embedding → layers →
logits) with one launch. Graphs need fixed shapes and addresses, so every input lives in a
static buffer, and a step of n rows runs the graph of a padded size.

What is the runner's, the same for every backend:
    sizes    1, 2, 4, ... below the cap, then the cap (min(cuda_graph_max_bs, max_num_seqs));
             a step of n rows uses the smallest size >= n
    capture  warm-up twice on a side stream (Triton compiles, cuBLAS workspaces), as torch's
             graph docs ask, then record; all graphs share one memory pool (they replay one at
             a time on one stream, and each graph's logits are sampled before the next replay);
             keys captured at init go largest first, so smaller graphs reuse the pool's memory
    forward  ids resolved from the future-token buffer inside the graph (overlap), model,
             logits [bs, vocab] fp32 and the final hidden states [bs, H] (what `block` drafts
             from); the step reads their first n rows
What is the backend's (AttentionBackend's hooks, ketch/attention/base.py): the static buffers
(ids and positions among them, so one host copy can carry everything), the key's other
dimensions (the torch backend's page bucket), what padded rows hold, whether a key is captured
at init or on first use.

Off CUDA nothing is captured: the same static-buffer forward runs eagerly, so CPU tests check
the padding and buffer logic of each backend without a GPU. Prefill and mixed steps stay eager.
"""
from __future__ import annotations

import torch

from ketch.attention.base import AttentionBackend, GraphKey
from ketch.forward_batch import ForwardBatch, StepKind
from ketch.runner.future_tokens import FutureTokens


def bucket(n: int) -> int:
    """Smallest power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


def capture_sizes(cap: int) -> list[int]:
    """Powers of two below `cap`, then `cap`: [1, 2, 4, ..., cap]."""
    sizes = [1 << i for i in range(cap.bit_length()) if 1 << i < cap]
    return sizes + [cap]


class GraphRunner:
    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, max_bs: int, max_model_len: int,
                 device: torch.device, future: FutureTokens | None = None) -> None:
        self.model, self.attn, self.device = model, attn, device
        self.load = getattr(model, "expert_load", None)  # ExpertLoad of an MoE model (count_rows)
        self.future = future  # None: the ids are never placeholders
        self.max_bs = max_bs
        self.sizes = capture_sizes(max_bs)
        self.capture = device.type == "cuda"
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        keys = attn.init_capture(self.sizes, max_model_len)
        if self.capture:
            for key in sorted(keys, reverse=True):  # largest first: the rest reuse its memory
                self.attn.prepare_capture(key)
                self.graphs[key] = self._capture(key)
            torch.cuda.synchronize(self.device)

    def captured_sizes(self) -> list[int]:
        return sorted({key[0] for key in self.graphs})

    def size_for(self, n: int) -> int:
        return min(bucket(n), self.max_bs)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.kind is StepKind.DECODE and batch.num_seqs <= self.max_bs and \
            self.attn.graph_key(batch, self.size_for(batch.num_seqs)) is not None

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, vocab] fp32 and final hidden states [n, H] of a decode-only step of n =
        batch.num_seqs rows that `can_run`: views of static buffers the next replay overwrites."""
        n = batch.num_seqs
        key = self.attn.graph_key(batch, self.size_for(n))
        assert key is not None, "run() of a step can_run() refuses"
        self.attn.prepare_replay(batch, key)
        if not self.capture:
            self._count_rows(n)
            logits, hidden = self._forward(key)
            return logits[:n], hidden[:n]
        entry = self.graphs.get(key)
        if entry is None:  # a key first seen now: the buffers hold this step, safe to rerun
            entry = self.graphs[key] = self._capture(key)
        graph, logits, hidden = entry
        self._count_rows(n)
        graph.replay()
        return logits[:n], hidden[:n]

    def _count_rows(self, n: int) -> None:
        """MoE models count routed picks per expert (/metrics, EPLB): of a padded step only its
        first n rows are traffic; warm-ups none."""
        if self.load is not None:
            self.load.count_rows(n)

    def _forward(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode forward of graph `key` on the static buffers (what the graph records)."""
        inputs = self.attn.capture_inputs(key)
        ids = inputs.ids if self.future is None else self.future.resolve(inputs.ids)
        hidden = self.model(ids, inputs.positions, self.attn, inputs.metadata)
        return self.model.compute_logits(hidden), hidden

    def _capture(self, key: GraphKey) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        self._count_rows(0)  # the warm-ups are no traffic (the graph records the masked count)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits, hidden = self._forward(key)
        return graph, logits, hidden
