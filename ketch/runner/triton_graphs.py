"""CUDA graphs of decode-only steps over the Triton attention path (EngineConfig.cuda_graph).

Captured once at init, before any request, for padded batch sizes 1, 2, 4, ... below the cap
and the cap itself (min(cuda_graph_max_bs, max_num_seqs)), largest first so the smaller graphs
reuse the memory the largest one took from the shared pool. A step of n decode rows replays
the graph of the smallest captured size >= n.

Static buffers, shared by every graph (they replay one at a time, on one stream):

    stage  int32 [4 * max_bs + max_bs * max_pages]  ← the step's one host→device copy (pinned)
           the graph of size bs reads ids, positions, kv_lens, slots at stage[0:bs],
           [bs:2bs], [2bs:3bs], [3bs:4bs]; the page rows [n, w] follow them
    table  int32 [max_bs, max_pages]   page table with a fixed row stride (baked into the
           graph); each step copies its [n, w] block in from the stage (one device copy).
           Columns past a row's length are stale and never read: kernels stop at kv_len.
    scratch fp32 split-K partials for the largest bs × splits, viewed per size

Padded rows: token 0 at position 0, kv_len 0, slot -1: the KV store writes nothing and
attention returns zeros, so padding never touches a request's pages. The split count is
fixed per size (the backend's count at max_model_len), and an eager decode step of the same
batch size uses the same count, so greedy output is bit-identical with graphs on or off.

Off CUDA (the Triton interpreter in CPU tests) nothing is captured: the same static-buffer
forward runs eagerly, so the padding and buffer logic are testable without a GPU.
"""
from __future__ import annotations

import numpy as np
import torch

from ketch.attention.triton_backend import DecodeMetadata, TritonAttentionBackend, TritonAttentionMetadata
from ketch.forward_batch import ForwardBatch, StepKind
from ketch.runner.cuda_graph import bucket
from ketch.runner.future_tokens import FutureTokens

PAD = (0, 0, 0, -1)  # token, position, kv_len, slot of a padded row


def capture_sizes(cap: int) -> list[int]:
    """Powers of two below `cap`, then `cap`: [1, 2, 4, ..., cap]."""
    sizes = [1 << i for i in range(cap.bit_length()) if 1 << i < cap]
    return sizes + [cap]


class TritonDecodeGraphs:
    def __init__(self, model: torch.nn.Module, attn: TritonAttentionBackend, max_bs: int, max_model_len: int,
                 device: torch.device, future: FutureTokens | None = None) -> None:
        self.model, self.attn, self.device = model, attn, device
        self.future = future  # None: the ids are never placeholders
        self.page_size = attn.page_size
        self.sizes = capture_sizes(max_bs)
        self.max_bs = max_bs
        self.max_pages = -(-max_model_len // self.page_size)
        self.splits = {bs: attn.splits_for(bs, max_model_len) for bs in self.sizes}
        int32 = dict(dtype=torch.int32, device=device)
        n_stage = 4 * max_bs + max_bs * self.max_pages
        self.stage = torch.zeros(n_stage, **int32)
        self.table = torch.zeros(max_bs, self.max_pages, **int32)
        self.host = torch.zeros(n_stage, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        partials = max(bs * s for bs, s in self.splits.items()) * attn.num_heads
        self.mid_o = torch.empty(partials * attn.head_dim, dtype=torch.float32, device=device)
        self.mid_lse = torch.empty(partials, dtype=torch.float32, device=device)
        self.capture = device.type == "cuda"
        self.copied = torch.cuda.Event() if self.capture else None  # the host buffer may be rewritten
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        if self.capture:
            self._capture_all()

    def captured_sizes(self) -> list[int]:
        return sorted(self.graphs)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.kind is StepKind.DECODE and batch.num_seqs <= self.max_bs

    def size_for(self, n: int) -> int:
        return min(bucket(n), self.max_bs)

    # ---------------------------------------------------------------- per step
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch.num_seqs, vocab] fp32 of a decode-only step."""
        n = batch.num_seqs
        bs = self.size_for(n)
        width = batch.page_table.shape[1]  # the widest row's pages
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the host buffer
        vec = self.host_np[: 4 * bs].reshape(4, bs)
        vec[0, :n], vec[1, :n], vec[3, :n] = batch.input_ids, batch.positions, batch.slots
        vec[2, :n] = vec[1, :n] + 1
        vec[:, n:] = np.array(PAD, dtype=np.int32)[:, None]
        used = 4 * bs + n * width
        self.host_np[4 * bs : used].reshape(n, width)[:] = batch.page_table
        self.stage[:used].copy_(self.host[:used], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.table[:n, :width].copy_(self.stage[4 * bs : used].view(n, width))
        if not self.capture:
            return self._forward(bs)[:n]
        self.graphs[bs].replay()
        return self.logits[bs][:n]

    # ---------------------------------------------------------------- capture
    def _forward(self, bs: int) -> torch.Tensor:
        """The decode forward of `bs` rows on the static buffers (what a graph records)."""
        s = self.stage
        splits = self.splits[bs]
        h, d = self.attn.num_heads, self.attn.head_dim
        scratch = (self.mid_o[: bs * h * splits * d].view(bs, h, splits, d),
                   self.mid_lse[: bs * h * splits].view(bs, h, splits))
        decode = DecodeMetadata(self.table[:bs], s[2 * bs : 3 * bs], splits, scratch)
        meta = TritonAttentionMetadata(s[3 * bs : 4 * bs], bs, decode, None)
        ids = s[:bs] if self.future is None else self.future.resolve(s[:bs])  # inside the graph
        hidden = self.model(ids, s[bs : 2 * bs], self.attn, meta)
        return self.model.compute_logits(hidden)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            self.stage[: 4 * bs].view(4, bs).copy_(torch.tensor(PAD, dtype=torch.int32)[:, None].expand(4, bs))
            # warm up on a side stream (Triton compiles, cuBLAS picks kernels), as torch's graph
            # docs ask; padded rows write nothing, so warm-up and capture leave the pool as it was
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
