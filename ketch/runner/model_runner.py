"""Owns the model, the KV pool and the attention backend; runs one step's forward pass.

The scheduler hands over `ScheduledChunk`s; the runner flattens them into one token stream
(decode-like chunks first), builds attention metadata once, runs the model and returns the
fp32 logits of the rows that sample.

Chosen once at init, never per step: the attention backend (`attention_backend`: Triton on
CUDA, torch on the CPU), the layer kernels (`layer_kernels`, same rule) and the decode CUDA
graphs (`cuda_graph`, on by default on CUDA; the Triton path captures every padded batch size
up front, the torch path on first use).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from ketch.attention.base import SeqChunk
from ketch.attention.registry import create_attention_backend
from ketch.cache.kv_pool import KVPool
from ketch.config import EngineConfig, ModelConfig
from ketch.layers.ops import layer_ops
from ketch.models.registry import model_class
from ketch.runner.cuda_graph import DecodeGraphs
from ketch.scheduler.scheduler import ScheduledChunk
from ketch.weights import detect_format, iter_weights
from ketch.weights.gguf_q4 import iter_q4_weights
from ketch.weights.source import resolve_model_path


def device_memory_bytes(device: torch.device) -> int:
    """CUDA: bytes free now (after the weights, once the allocator's cache is returned);
    CPU: physical memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks freed during loading count as free, not as torch's cache
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_memory:
        return config.kv_cache_memory
    fraction = config.gpu_kv_cache_fraction if device.type == "cuda" else config.kv_cache_fraction
    return int(device_memory_bytes(device) * fraction)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters directly in `dtype`: an 8B model is never materialized in fp32 first."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            # Denormals (tiny activations, underflowing softmax terms) slow x86 float math by
            # ~50x here; flushing them to zero changes nothing a token could notice.
            torch.set_flush_denormal(True)
        self.attention_backend = config.resolved_attention_backend
        self.ops = layer_ops(config.resolved_layer_kernels)
        self.model = self._load_model(max_model_len)
        self.pool = self._allocate_pool()
        self.attn = create_attention_backend(self.attention_backend, self.pool, model_config.num_heads,
                                             model_config.head_dim, self.device, max_model_len=max_model_len)
        self.graphs: Any = None  # DecodeGraphs | TritonDecodeGraphs
        if config.use_cuda_graph:  # EngineConfig has checked that the device is CUDA
            max_bs = min(config.cuda_graph_max_bs, config.max_num_seqs)
            if self.attention_backend == "triton":
                from ketch.runner.triton_graphs import TritonDecodeGraphs  # Triton is imported only on this path

                # The pool exists first: the graphs bake its addresses in. Their own memory (a few
                # hundred MB of activations and logits) comes out of the 1 - gpu_kv_cache_fraction
                # of free memory that the pool leaves.
                self.graphs = TritonDecodeGraphs(self.model, self.attn, max_bs, max_model_len, self.device)
            else:
                max_pages = -(-max_model_len // config.page_size)
                self.graphs = DecodeGraphs(self.model, self.attn, max_bs, max_pages, self.device)

    def _load_model(self, max_model_len: int) -> torch.nn.Module:
        cfg = self.model_config
        # Rotary tables are built with an explicit fp32 dtype, so they stay fp32 here.
        with torch.device(self.device), default_dtype(self.dtype):
            model = model_class(cfg)(cfg, max_positions=max_model_len, ops=self.ops)
        for param in model.parameters():  # a no-op unless a layer pins its own dtype
            param.data = param.data.to(self.dtype)
        # dummy weights are drawn on the target device (seconds for 8B on a GPU, not minutes on the CPU)
        weights = iter_weights(self.config.model, cfg, self.dtype, self.config.load_format,
                               seed=self.config.seed, device=self.device)
        model.load_weights(weights)
        if self._keeps_4bit():
            model.load_int4(iter_q4_weights(resolve_model_path(self.config.model), cfg))
        return model.eval()

    def _keeps_4bit(self) -> bool:
        """The int4 kernel is a CPU kernel with bf16 activations; only GGUF files carry 4-bit blocks."""
        ec = self.config
        return (
            ec.quantization == "auto" and self.device.type == "cpu" and self.dtype == torch.bfloat16
            and detect_format(resolve_model_path(ec.model), ec.load_format) == "gguf"
        )

    def _allocate_pool(self) -> KVPool:
        cfg, ec = self.model_config, self.config
        per_page = KVPool.bytes_per_page(cfg.num_layers, ec.page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        budget = kv_budget_bytes(ec, self.device)
        return KVPool(cfg.num_layers, budget // per_page, ec.page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run the step; returns logits [rows that sample, vocab] in fp32, in `chunks` order."""
        if self.graphs is not None and self.graphs.can_run(chunks):
            return self.graphs.run(chunks)
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqChunk] = []
        sample_rows: list[int] = []
        for c in chunks:
            req, start = c.req, c.req.num_computed
            ids.extend(req.tokens(start, start + c.num_new))
            positions.extend(range(start, start + c.num_new))
            seqs.append(SeqChunk(start, c.num_new, req.page_table))
            if c.samples:
                sample_rows.append(len(ids) - 1)
        meta = self.attn.init_metadata(seqs)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos, self.attn, meta)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
