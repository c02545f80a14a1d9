"""Owns the model, the KV pool and the attention backend; runs one step's forward pass.

The engine hands over the step's `ForwardBatch` (ketch/forward_batch.py: one token stream,
decode-like sequences first, slots computed); the runner builds attention metadata once, runs
the model and returns the fp32 logits of the rows that sample.

Chosen once at init, never per step: the attention backend (the family's `make_attention`:
a family with its own KV layout brings its own backend, the others get the registry's,
`attention_backend`: Triton on CUDA, torch on the CPU), the layer kernels (`layer_kernels`,
same rule) and the decode CUDA graphs (`cuda_graph`, on by default on CUDA; one graph runner,
graph_runner.py, for every backend: the Triton backend has it capture every padded batch size
up front, the torch backend each (size, page bucket) on first use).

On CUDA the KV pool is sized by memory_plan.py (`mem_fraction_static`, measured headroom for
the graphs and the largest eager step); on the CPU by `kv_cache_fraction` of the memory.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch

from ketch.attention.base import AttentionBackend
from ketch.attention.idle import IDLE_ATTENTION
from ketch.cache.kv_pool import KVPool
from ketch.config import EngineConfig
from ketch.cpu_bf16 import cpu_has_native_bf16
from ketch.forward_batch import ForwardBatch
from ketch.host_copy import to_device
from ketch.host_memory import available_memory_bytes
from ketch.layers.int4_crossover import calibrate as calibrate_int4
from ketch.layers.linear import dense_in_fp32, use_activations
from ketch.layers.ops import layer_ops
from ketch.layers.vocab_parallel import VocabParallelEmbedding
from ketch.models.family import FamilyConfig
from ketch.models.registry import family_for
from ketch.parallel import SINGLE, ParallelContext
from ketch.runner.cpu_compile import CPU_COMPILE_MAX_BS, CompiledCPUDecode
from ketch.runner.graph_runner import GraphRunner
from ketch.runner.layer_waits import LayerWaitingAttention
from ketch.runner.future_tokens import FutureTokens
from ketch.runner.memory_plan import MemoryPlan, plan_gpu_pool
from ketch.weights import ModelSource, iter_weights
from ketch.weights.gguf_q4 import iter_q4_weights


def kv_budget_bytes(config: EngineConfig) -> int:
    """CPU pool: kv_cache_memory, else kv_cache_fraction of the physical memory (CUDA: MemoryPlan)."""
    if config.kv_cache_memory:
        return config.kv_cache_memory
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * config.kv_cache_fraction)


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
    def __init__(self, config: EngineConfig, model_config: FamilyConfig, max_model_len: int,
                 source: ModelSource | None = None, parallel: ParallelContext = SINGLE) -> None:
        """source: the model as the engine resolved it (None: resolve it from `config` here);
        parallel: the rank's tensor-parallel context: the model, the pool and the attention
        backend hold this rank's heads (every rank builds its own runner; engine/tp_ranks.py)."""
        if config.cpu_compile and config.torch_device.type != "cpu":
            raise ValueError(f"cpu_compile: needs the CPU device, got device={config.device!r}")
        self.parallel = parallel
        self.forwards = 0  # forward passes run, idle ones included (DP attention keeps the ranks in step by it)
        self.config = config
        self.model_config = model_config
        # model, KV layout, weights and attention backend all come from the family: nothing
        # here reads a family's config fields (head counts, dims)
        self.family = family_for(model_config.architecture)
        if config.cpu_compile and not self.family.cpu_compile:
            raise ValueError(f"cpu_compile: traces the dense (Llama-family) decode step only; "
                             f"{model_config.architecture} ({self.family.name} family) runs its decode steps eagerly")
        self.source = source or ModelSource.resolve(config.model, config.load_format, config.tokenizer)
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            # Denormals (tiny activations, underflowing softmax terms) slow x86 float math by
            # ~50x here; flushing them to zero changes nothing a token could notice.
            torch.set_flush_denormal(True)
        self.attention_backend = config.resolved_attention_backend
        self.ops = layer_ops(config.resolved_layer_kernels, self.dtype)
        # sampled ids stay on the device; the next step reads them from here (overlap)
        self.future = FutureTokens(config.max_num_seqs, model_config.vocab_size, self.device)
        # the last step's sampled rows' final hidden states (forward); a graph step's are copied out
        # of its static buffer only when a proposer drafts from them a step later (set by
        # build_engine from Speculation.needs_hidden; other TP ranks never need them)
        self.last_hidden: torch.Tensor | None = None
        self.keep_hidden = False
        self.model = self._load_model(max_model_len)
        # MoE families count routed picks per expert (ExpertLoad: totals() for /metrics); None otherwise
        self.expert_load = getattr(self.model, "expert_load", None)
        # Graphs bake the pool's addresses in, so the pool comes first; its size leaves room for
        # them and the largest eager step, measured on a scratch pool (memory_plan.py).
        build_graphs = functools.partial(self._build_graphs, max_model_len=max_model_len) \
            if config.use_cuda_graph else None  # EngineConfig has checked that the device is CUDA
        self.memory_plan: MemoryPlan | None = None if self.device.type != "cuda" else \
            plan_gpu_pool(self.model, config, model_config, max_model_len, build_graphs)
        self.pool = self._allocate_pool()
        self.attn = self.family.make_attention(model_config, self.pool, backend=self.attention_backend,
                                               parallel=self.parallel, device=self.device, max_model_len=max_model_len)
        self.graphs: GraphRunner | CompiledCPUDecode | None = build_graphs(self.attn) if build_graphs else \
            self._compiled_cpu_decode() if config.cpu_compile else None
        if self.memory_plan is not None:
            free, _ = torch.cuda.mem_get_info(self.device)
            print(f"ketch: {self.memory_plan.describe()}; {free / 2**30:.2f} GiB free after graph capture",
                  file=sys.stderr)

    def _build_graphs(self, attn: AttentionBackend, max_model_len: int) -> GraphRunner:
        """Decode graphs over `attn` (the real backend, or memory_plan's scratch one)."""
        c = self.config  # a speculative verify runs k + 1 decode rows per sequence
        rows_per_seq = 1 + c.speculative_num_draft_tokens if c.speculative_algorithm else 1
        max_bs = min(c.cuda_graph_max_bs, c.max_num_seqs * rows_per_seq)
        return GraphRunner(self.model, attn, max_bs, max_model_len, self.device, future=self.future)

    def _compiled_cpu_decode(self) -> CompiledCPUDecode:
        """CPU decode steps through one compiled graph per padded size (cpu_compile.py)."""
        max_bs = min(CPU_COMPILE_MAX_BS, self.config.max_num_seqs)
        return CompiledCPUDecode(self.model, self.attn, max_bs, self.device, self.future)

    def _load_model(self, max_model_len: int) -> torch.nn.Module:
        cfg, family = self.model_config, self.family
        # Rotary tables are built with an explicit fp32 dtype, so they stay fp32 here.
        with torch.device(self.device), default_dtype(self.dtype):
            model = family.model_class(cfg, max_positions=max_model_len, ops=self.ops, parallel=self.parallel)
        fp32 = family.fp32_weights  # those stay fp32 whatever the model's dtype (name suffixes)
        for name, param in model.named_parameters():  # a no-op unless a layer pins its own dtype
            param.data = param.data.to(torch.float32 if name.endswith(fp32) else self.dtype)
        # Every rank reads the full tensors and keeps its slice. Dummy weights are drawn on the
        # target device (seconds for 8B on a GPU, not minutes on the CPU).
        weights = iter_weights(self.source, family.weight_shapes(cfg), self.dtype, seed=self.config.seed,
                               device=self.device, fp32=fp32)
        model.load_weights(weights)
        if self._keeps_4bit():
            held = model.load_int4(iter_q4_weights(self.source.path))
            if held and self.dtype == torch.bfloat16 and not cpu_has_native_bf16():
                # an emulated bf16 GEMM loses to fp32 (linear.py), if a quarter of the free memory holds the copies
                if not dense_in_fp32(model.modules(), available_memory_bytes() // 4):
                    print("ketch: the dense copies stay bf16: fp32 ones would not fit in a quarter of the free "
                          "memory", file=sys.stderr)
            if self.config.cpu_activations != "int16" \
                    and not use_activations(model.modules(), self.config.cpu_activations):
                print(f"ketch: cpu_activations {self.config.cpu_activations}: ketch's 4-bit kernel is not built "
                      "here; torch's int4 kernel keeps bf16 activations", file=sys.stderr)
            # up to how many tokens the 4-bit kernel beats the dense GEMM on this machine, per shape
            t0 = time.perf_counter()
            crossings, source = calibrate_int4(model.modules())
            print(f"ketch: 4-bit weights for steps of up to {min(crossings.values(), default=0)}-"
                  f"{max(crossings.values(), default=0)} tokens ({source} per shape in "
                  f"{time.perf_counter() - t0:.2f} s: "
                  f"{', '.join(f'{o}x{i}: {n}' for (o, i), n in sorted(crossings.items()))})", file=sys.stderr)
        # one-row logits: mv, GEMM or int8 rows, timed here (on the head compute_logits uses, where
        # the family says which: DecoderStack.logits_head)
        head = getattr(model, "logits_head", None)
        if isinstance(head, VocabParallelEmbedding) and head.dense is None and self.device.type == "cpu" \
                and self.dtype != torch.float32:
            head.pick_one_row_kernel()
            head.pick_many_rows_kernel()  # int8 blocks for steps of up to as many rows as they win
        return model.eval()

    def _keeps_4bit(self) -> bool:
        """The int4 kernel is a CPU kernel with bf16 activations; only GGUF files carry 4-bit blocks."""
        return (self.config.quantization == "auto" and self.device.type == "cpu" and self.dtype == torch.bfloat16
                and self.source.is_gguf)

    def _allocate_pool(self) -> KVPool:
        cfg, ec = self.model_config, self.config
        kv_dtype = ec.kv_torch_dtype  # the model dtype, or fp8 (half the bytes: twice the pages)
        spec = self.family.kv_spec(cfg, self.parallel)  # this rank's share
        per_page = spec.bytes_per_page(ec.page_size, kv_dtype, self.dtype)
        budget = self.memory_plan.pool_bytes if self.memory_plan else kv_budget_bytes(ec)
        # every rank's pool holds the same pages (rank 0 hands out page numbers for all): the
        # smallest of the ranks' budgets (a collective: every rank builds its runner in step)
        num_pages = self.parallel.min_over_ranks(budget // per_page, self.device)
        return KVPool(spec, num_pages, ec.page_size, kv_dtype, self.device, compute_dtype=self.dtype)

    @torch.inference_mode()
    def forward_idle(self) -> None:
        """The model over zero tokens: a DP-attention rank with nothing scheduled joins the MoE
        layers' collectives of the others' forward (engine/dp_attention.py)."""
        self.forwards += 1
        none = torch.empty(0, dtype=torch.int64, device=self.device)
        self.model(none, none, IDLE_ATTENTION, None)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the step; returns logits [len(batch.sample_rows), vocab] in fp32, in sampling order."""
        self.forwards += 1
        # a host-tier load queued since the last step (CUDA; None otherwise: one read per step)
        pending = self.pool.take_pending_load()
        if self.graphs is not None and self.graphs.can_run(batch):
            if pending is not None:
                pending.wait_all()  # a captured graph holds no per-layer waits: the whole load first
            logits, hidden = self.graphs.run(batch)
            # the copy is stream-ordered before the next replay (overlap launches it before this
            # step's outputs are read)
            self.last_hidden = hidden.clone() if self.keep_hidden else None
            return logits
        attn = self.attn if pending is None else LayerWaitingAttention(self.attn, pending)
        if self.expert_load is not None:  # an eager step: every row is traffic
            self.expert_load.count_rows(None)
        meta = attn.init_metadata(batch)
        # one copy for ids, positions and sampling rows; placeholders (overlap) resolve on the device
        host = to_device(np.concatenate((batch.input_ids, batch.positions, batch.sample_rows)), self.device)
        n = batch.num_tokens
        input_ids = self.future.resolve(host[:n])
        hidden = self.model(input_ids, host[n : 2 * n], attn, meta)
        # the sampled rows' final hidden states, kept until the next step (`block` drafts from them)
        self.last_hidden = hidden.index_select(0, host[2 * n :])
        return self.model.compute_logits(self.last_hidden)
