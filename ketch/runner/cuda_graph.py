"""CUDA graphs of the decode-only forward pass over the torch attention path (EngineConfig.cuda_graph).

An eager 8B decode step launches ~1,000 small kernels, and at batch 1 the host cannot issue
them as fast as the GPU runs them. A graph replays the whole forward (embedding → layers →
logits) with one launch. Graphs need fixed shapes and addresses, so:

    step inputs ──copy──► static buffers [max_bs] / [max_bs, max_pages]
    graph key   = (batch bucket, page bucket)   powers of two, captured on first use
    padded rows = copies of row 0 (same token, position, slot, pages): they compute the very
                  same K/V and write it to row 0's slot, so padding never touches another
                  request's pages
    padded pages= row's own first page, masked out (-inf) like the eager path's padding

The mask is built inside the graph from the static lengths. All graphs share one memory pool:
they run one at a time on one stream, and each graph's output is read (sampled) before the
next replay. Prefill and mixed steps stay eager.
"""
from __future__ import annotations

import numpy as np
import torch

from ketch.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from ketch.forward_batch import ForwardBatch, StepKind
from ketch.host_copy import to_device
from ketch.runner.future_tokens import FutureTokens


def bucket(n: int) -> int:
    """Smallest power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, attn: TorchAttentionBackend, max_bs: int, max_pages: int,
                 device: torch.device, future: FutureTokens | None = None) -> None:
        self.model, self.attn, self.device = model, attn, device
        self.future = future  # None: the ids are never placeholders
        self.page_size = attn.page_size
        self.max_bs = bucket(max_bs)
        self.max_pages = bucket(max_pages)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(self.max_bs, **long)
        self.positions = torch.zeros(self.max_bs, **long)
        self.slots = torch.zeros(self.max_bs, **long)
        self.lens = torch.ones(self.max_bs, **long)
        self.pages = torch.zeros(self.max_bs, self.max_pages, **long)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Off CUDA the same static-buffer forward runs eagerly: CPU tests check the padding logic.
        self.capture = device.type == "cuda"
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.kind is StepKind.DECODE and batch.num_seqs <= self.max_bs and \
            int(batch.kv_lens.max()) <= self.max_pages * self.page_size

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch.num_seqs, vocab] fp32 of a decode-only step."""
        n = batch.num_seqs
        bs = bucket(n)
        used = batch.pages_used
        pb = bucket(int(used.max()))
        rows = np.empty((bs, pb), np.int64)
        rows[:n, : batch.page_table.shape[1]] = batch.page_table
        # past its own pages a row repeats its first page (masked out, never written)
        rows[:n] = np.where(np.arange(pb)[None, :] < used[:, None], rows[:n], rows[:n, :1])
        rows[n:] = rows[0]  # padded rows are copies of row 0
        pad = bs - n
        vectors = np.stack([np.concatenate((v, v[:1].repeat(pad)))
                            for v in (batch.input_ids, batch.positions, batch.slots, batch.kv_lens)])
        dev = to_device(vectors, self.device, torch.long)
        self.input_ids[:bs].copy_(dev[0])
        self.positions[:bs].copy_(dev[1])
        self.slots[:bs].copy_(dev[2])
        self.lens[:bs].copy_(dev[3])
        self.pages[:bs, :pb].copy_(to_device(rows, self.device, torch.long))
        if not self.capture:
            return self._forward(bs, pb)[:n]
        key = (bs, pb)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bs, pb)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:n]

    def _forward(self, bs: int, pb: int) -> torch.Tensor:
        """The decode forward on the static buffers (what the graph records)."""
        visible = torch.arange(pb * self.page_size, device=self.device)[None, :] < self.lens[:bs, None]
        mask = torch.zeros(visible.shape, dtype=self.attn.pool.compute_dtype, device=self.device)
        mask.masked_fill_(~visible, float("-inf"))  # additive, as the eager path builds it
        meta = TorchAttentionMetadata(
            slots=self.slots[:bs], num_decode=bs, decode_pages=self.pages[:bs, :pb],
            decode_mask=mask[:, None, None, :], prefills=[],
        )
        ids = self.input_ids[:bs] if self.future is None else self.future.resolve(self.input_ids[:bs])
        hidden = self.model(ids, self.positions[:bs], self.attn, meta)
        return self.model.compute_logits(hidden)

    def _capture(self, bs: int, pb: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream (lazy inits, cuBLAS workspaces) as torch's graph docs ask;
        # each run rewrites the same K/V into the same slots, so it changes nothing.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bs, pb)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits = self._forward(bs, pb)
        return graph, logits
