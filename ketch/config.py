"""Frozen configuration dataclasses. Derived values are properties, never stored twice."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union

from ketch.config_checks import (DISAGGREGATION_MODES, check_device, check_disaggregation, check_expert_parallel,
                                 check_hicache, check_kernels, check_sizes, check_speculative, device_type)
from ketch.config_checks import (_STORAGE_URL_FORMS, HICACHE_IO_BACKENDS, HICACHE_STORAGE_BACKENDS,
                                 HICACHE_WRITE_POLICIES, SPECULATIVE_ALGORITHMS, WILDCARD_HOSTS)
from ketch.cpu_bf16 import cpu_has_native_bf16
from ketch.hf_config import check_hf_fields, sliding_window

if TYPE_CHECKING:  # torch is imported where a value needs it: `ketch serve` builds and checks this
    import torch   # config before it launches the engine process, which torch's import would delay

# the flags' choices live with their checks (config_checks.py); importers read them from here
__all__ = ["DISAGGREGATION_MODES", "HICACHE_IO_BACKENDS", "HICACHE_STORAGE_BACKENDS", "HICACHE_WRITE_POLICIES",
           "SPECULATIVE_ALGORITHMS", "WILDCARD_HOSTS", "_STORAGE_URL_FORMS", "EngineConfig", "ModelConfig",
           "RopeScaling", "KVTensorSpec", "KVSpec", "KV_CACHE_DTYPES", "CPU_ACTIVATIONS", "cpu_has_native_bf16"]

LoadFormat = Literal["auto", "gguf", "hf", "dummy"]
Quantization = Literal["auto", "none"]
CPU_ACTIVATIONS = ("int16", "int8")  # EngineConfig.cpu_activations (ketch/native/q4.py's ACTIVATIONS)
KVCacheDtype = Literal["auto", "fp8_e4m3"]
SchedulePolicy = Literal["fcfs", "lpm"]
HiCacheWritePolicy = Literal["write_through", "write_back"]
HiCacheIOBackend = Literal["direct", "kernel"]



@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type "llama3"); None in ModelConfig means plain RoPE."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3)."""

    architecture: str  # registry key, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # the attention window of the layers that have one (Mistral; Qwen2/3 with use_sliding_window):
    # ketch attends to every earlier token, which is the same only while the context fits in the
    # window, so the engine caps the context there (engine/build.py)
    sliding_window: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dictionary (transformers 4.x or 5.x layout)."""
        check_hf_fields(d)
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        model_type = d.get("model_type", "llama")
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling("llama3", float(rope["factor"]), float(rope.get("low_freq_factor", 1.0)),
                                  float(rope.get("high_freq_factor", 4.0)),
                                  int(rope.get("original_max_position_embeddings", 8192)))
        elif rope_type not in ("default", None):
            raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=archs[0],
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"], num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=scaling, max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding_window(d, model_type),
        )



# How a KV tensor's element type is chosen: "kv" follows EngineConfig.kv_torch_dtype (the model
# dtype, or fp8 e4m3 pages), "model" is always the model dtype, a torch.dtype is fixed.
KVDtypeRule = Union[Literal["kv", "model"], "torch.dtype"]


@dataclass(frozen=True)
class KVTensorSpec:
    """One tensor a layer keeps per token, e.g. K of [kv_heads, head_dim] (this rank's share)."""

    name: str
    shape: tuple[int, ...]
    dtype: KVDtypeRule = "kv"

    def __post_init__(self) -> None:
        import torch

        if not self.name:
            raise ValueError("KVTensorSpec.name must not be empty")
        if not self.shape or any(not isinstance(n, int) or n < 1 for n in self.shape):
            raise ValueError(f"KVTensorSpec.shape of {self.name!r} must be positive ints, got {self.shape}")
        if not isinstance(self.dtype, torch.dtype) and self.dtype not in ("kv", "model"):
            raise ValueError(f"KVTensorSpec.dtype of {self.name!r} must be 'kv', 'model' or a torch.dtype, "
                             f"got {self.dtype!r}")

    def torch_dtype(self, kv_dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
        if self.dtype not in ("kv", "model"):
            return self.dtype  # a torch.dtype (__post_init__)
        return kv_dtype if self.dtype == "kv" else model_dtype

    def bytes_per_token(self, kv_dtype: torch.dtype, model_dtype: torch.dtype) -> int:
        return math.prod(self.shape) * self.torch_dtype(kv_dtype, model_dtype).itemsize


@dataclass(frozen=True)
class KVSpec:
    """The KV a model keeps for each token: the same named tensors in every layer. A model family
    declares it (`kv_spec(config, parallel)`, ketch/models/family.py); the pool, the memory plan
    and anything that sizes or moves pages read it instead of a model's head counts.

    MHA/GQA: "k" and "v" of [kv_heads, head_dim] (`KVSpec.mha`); an MLA model: one latent
    tensor per layer. `model_dtype` below defaults to `kv_dtype` (a pool in the model's dtype)."""

    num_layers: int
    tensors: tuple[KVTensorSpec, ...]

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"KVSpec.num_layers must be >= 1, got {self.num_layers}")
        if not self.tensors:
            raise ValueError("KVSpec.tensors must name at least one tensor")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"KVSpec.tensors: names must be unique, got {self.names}")

    @classmethod
    def mha(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVSpec:
        """K and V of [num_kv_heads, head_dim] per layer (MHA, GQA, MQA)."""
        shape = (num_kv_heads, head_dim)
        return cls(num_layers, (KVTensorSpec("k", shape), KVTensorSpec("v", shape)))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def bytes_per_token(self, kv_dtype: torch.dtype, model_dtype: torch.dtype | None = None) -> int:
        """Every layer's tensors for one token."""
        model_dtype = kv_dtype if model_dtype is None else model_dtype
        return self.num_layers * sum(t.bytes_per_token(kv_dtype, model_dtype) for t in self.tensors)

    def bytes_per_page(self, page_size: int, kv_dtype: torch.dtype, model_dtype: torch.dtype | None = None) -> int:
        return page_size * self.bytes_per_token(kv_dtype, model_dtype)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start; the step loop reads, never branches on, these."""

    model: str | None = None  # GGUF file, HF directory, or config.json (dummy); None: bundled SmolLM2
    # where the tokenizer comes from when not from the model (a GGUF file or an HF directory): gives
    # a dummy-weight model real text (benchmarks of real shapes), or replaces a model's own
    tokenizer: str | None = None
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    load_format: LoadFormat = "auto"
    seed: int = 0  # dummy weights and unseeded sampling start from here
    page_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: sized by the fraction below for the device
    kv_cache_fraction: float = 0.05  # CPU: of the physical memory
    # CUDA: the fraction of the device's total memory that weights + KV pool may use (SGLang's
    # meaning); the pool also leaves the measured room for the decode graphs and the largest
    # eager step (ketch/runner/memory_plan.py).
    mem_fraction_static: float = 0.9
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256  # running requests at once
    max_num_batched_tokens: int = 2048  # token budget of one step
    chunked_prefill_size: int | None = None  # None: no chunking beyond the token budget
    enable_prefix_cache: bool = True
    schedule_policy: SchedulePolicy = "fcfs"
    num_threads: int | None = None  # torch CPU threads; None: torch's default
    # "auto": on the CPU in bf16, a GGUF's 4-bit (Q4_0/Q4_1) matrices also stay 4-bit for
    # small-batch decode (~4x fewer bytes per token); "none": dense weights only.
    quantization: Quantization = "auto"
    # How ketch's 4-bit CPU product rounds the activations, per block of 32 (ketch/native/q4_matmul.c):
    # "int16" (the default: finer than bf16 for every value within 2^7 of its block's largest) or
    # "int8" (opt-in: llama.cpp's rounding, ~1.9x less arithmetic where the product is compute
    # bound, e.g. 32 streams without AMX; greedy tokens agree with fp32 less often).
    cpu_activations: str = "int16"
    # CUDA: replay decode-only steps of up to cuda_graph_max_bs requests as CUDA graphs
    # (runner/). None: on when the device is CUDA; True: required (a ValueError off CUDA); False: off.
    cuda_graph: bool | None = None
    cuda_graph_max_bs: int = 256
    cpu_compile: bool = False  # CPU: decode steps as torch.compile'd graphs (runner/cpu_compile.py)
    # Overlap scheduling: schedule and launch step N+1 while step N runs; N's tokens are
    # processed one step late. None: on for CUDA (the CPU computes the step itself, so there is
    # nothing to overlap); True / False force it (A/B runs; CPU tests run both).
    overlap_schedule: bool | None = None
    # "auto": Triton kernels on CUDA, torch on the CPU; "torch" / "triton" force one (A/B runs).
    attention_backend: str = "auto"  # paged attention + KV store (ketch/attention/)
    layer_kernels: str = "auto"  # RMSNorm (+ residual add), RoPE, SiLU·mul (ketch/layers/ops.py)
    # KV pool element type. "auto": the model dtype. "fp8_e4m3": torch.float8_e4m3fn pages (half
    # of bf16's bytes: twice the tokens fit, decode reads half the bytes), per-tensor scale 1.0
    # (ketch/cache/kv_pool.py); any device (the CPU runs it through the torch path).
    kv_cache_dtype: KVCacheDtype = "auto"
    # Tensor parallelism: the engine runs rank 0 and spawns ranks 1..N-1 (engine/tp_ranks.py);
    # each rank holds 1/N of the heads, MLP features and vocabulary.
    tensor_parallel_size: int = 1
    # Expert parallelism of MoE models (SGLang's flags; ketch/parallel/expert.py): ep_size 1 or
    # tensor_parallel_size (whole experts split over the TP ranks, attention stays TP).
    ep_size: int = 1
    enable_dp_attention: bool = False  # an engine per rank, experts split over them (engine/dp_attention.py)
    ep_num_redundant_experts: int = 0  # EPLB's extra physical expert slots (replicas of hot experts)
    enable_eplb: bool = False  # re-place experts from their measured load ...
    eplb_rebalance_num_iterations: int = 1000  # ... every this many forward steps
    # /metrics: tokens routed to each expert of each MoE layer (ketch_moe_expert_tokens_total). Off
    # by default: DeepSeek-V3 has 58 x 256 such series, too many for every scrape (a gateway's is
    # every second).
    enable_expert_distribution_metrics: bool = False
    # Hierarchical KV cache (SGLang's HiCache flags): pages evicted from the device pool go to a
    # host-memory pool (L2) and come back on a hit (ketch/cache/hiradix.py). Host pool size:
    # hicache_size GB when given, else hicache_ratio × the device pool. write_through copies pages
    # to the host when they enter the prefix cache, write_back when they leave the device.
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float | None = None  # GB (10^9 bytes); takes precedence over the ratio
    hicache_write_policy: HiCacheWritePolicy = "write_through"
    # How a CUDA load / save copies page lists too fragmented for one DMA per run
    # (ketch/cache/layer_loader.py): "direct" gathers on the host (loads) or the device (saves)
    # and DMAs; "kernel" runs page-copy kernels that read / write the pinned host pool through
    # the GPU's mapping of it (no host gather on the engine thread). The CPU ignores it.
    hicache_io_backend: HiCacheIOBackend = "kernel"
    # L3 storage below the host pool (ketch/cache/storage_tier.py): pages that get a host copy are
    # also written to it in the background (a bounded queue of hicache_storage_write_queue pages; a
    # full queue drops the write, counted), and a request whose prompt continues past the cached
    # prefix waits at admission up to hicache_prefetch_timeout s for the pages the store has, then
    # uses whatever arrived. url None: the backend's default (file: $XDG_CACHE_HOME/ketch/kv or
    # ~/.cache/ketch/kv; redis: redis://127.0.0.1:6379/0; mooncake: mooncake://127.0.0.1:50051).
    hicache_storage_backend: str | None = None
    hicache_storage_url: str | None = None
    hicache_prefetch_timeout: float = 1.0
    hicache_storage_write_queue: int = 1024
    # PD disaggregation (ketch/disagg/README.md): prefill sends prompts' KV + first token, decode receives them
    disaggregation_mode: str = "null"  # null: colocated | prefill | decode (SGLang's flags)
    disaggregation_transfer_backend: str = "tcp"  # fake (moves no bytes) | tcp | nixl | mooncake
    disaggregation_bootstrap_host: str = "127.0.0.1"  # prefill: where its bootstrap server binds
    disaggregation_bootstrap_port: int = 8998  # prefill: its bootstrap server's port (0: any free one)
    disaggregation_timeout: float = 300.0  # s, each: the sides finding each other, KV starting, KV all there
    # Speculative decoding (ketch/spec/README.md; SGLang's flags): each decode step also verifies
    # up to speculative_num_draft_tokens proposed tokens per request; output is unchanged.
    speculative_algorithm: str | None = None  # ngram | draft | block
    speculative_num_draft_tokens: int = 4
    speculative_draft_model_path: str | None = None
    speculative_ngram_min_match_window_size: int = 1  # ngram: shortest suffix that may match
    speculative_ngram_max_match_window_size: int = 12  # ngram: longest suffix tried first
    # True: speculate only at batch sizes where measured verify steps beat plain ones
    # (spec/cost_model.py); False: always (A/B runs, tests that must exercise every verify)
    speculative_adaptive: bool = True

    def __post_init__(self) -> None:
        check_device(self.device)
        check_sizes(self)
        check_hicache(self)
        check_speculative(self)
        check_disaggregation(self, DISAGGREGATION_MODES)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")
        check_expert_parallel(self)
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be 'fcfs' or 'lpm', got {self.schedule_policy!r}")
        if self.load_format not in ("auto", "gguf", "hf", "dummy"):
            raise ValueError(f"load_format must be auto|gguf|hf|dummy, got {self.load_format!r}")
        if self.quantization not in ("auto", "none"):
            raise ValueError(f"quantization must be 'auto' or 'none', got {self.quantization!r}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.cuda_graph and self.device_type != "cuda":
            raise ValueError(f"cuda_graph: needs a CUDA device, got device={self.device!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto|{'|'.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise ValueError(f"cpu_activations must be {'|'.join(CPU_ACTIVATIONS)}, got {self.cpu_activations!r}")
        if self.cpu_activations != "int16" and (self.device_type != "cpu" or self.quantization == "none"
                                                 or self.dtype == "float32"):  # fp32 dequantizes: no 4-bit product
            raise ValueError(f"cpu_activations={self.cpu_activations!r} is a setting of the CPU's 4-bit product: it "
                             f"needs device cpu, quantization auto and a dtype other than float32 (got "
                             f"{self.device!r}, {self.quantization!r}, {self.dtype!r})")
        for name in ("attention_backend", "layer_kernels"):
            check_kernels(name, getattr(self, name), self.device)

    @property
    def use_cuda_graph(self) -> bool:
        return self.device_type == "cuda" if self.cuda_graph is None else self.cuda_graph

    @property
    def use_overlap_schedule(self) -> bool:
        return self.device_type == "cuda" if self.overlap_schedule is None else self.overlap_schedule

    @property
    def resolved_attention_backend(self) -> str:
        return _resolve_kernels(self.attention_backend, self.device_type)

    @property
    def resolved_layer_kernels(self) -> str:
        """auto: Triton on CUDA, ketch's C ops on the CPU (torch's where they do not apply), torch's
        under `cpu_compile` (its graph fuses them itself; eager steps then round as it does)."""
        if self.layer_kernels == "auto" and self.device_type == "cpu":
            return "torch" if self.cpu_compile else "native"
        return _resolve_kernels(self.layer_kernels, self.device_type)

    @property
    def device_type(self) -> str:
        """"cpu" or "cuda" ("auto": whether torch finds CUDA)."""
        return device_type(self.device)

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device_type if self.device == "auto" else self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """"auto": bf16 on CUDA and on CPUs with native bf16, else fp32; the engine then makes it
        bf16 for a 4-bit GGUF model on any CPU ketch's C kernels run on (runner/cpu_dtype.py)."""
        import torch

        if self.dtype == "auto":
            native_bf16 = self.device_type == "cuda" or cpu_has_native_bf16()
            return torch.bfloat16 if native_bf16 else torch.float32
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        except KeyError:
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}") from None

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """Element type of the KV pool's pages ("auto": the model's torch_dtype)."""
        import torch

        return self.torch_dtype if self.kv_cache_dtype == "auto" else getattr(torch, KV_CACHE_DTYPES[self.kv_cache_dtype])

    @property
    def prefill_chunk(self) -> int:
        """Most new tokens one request may take in a step."""
        chunk = self.chunked_prefill_size or self.max_num_batched_tokens
        return min(chunk, self.max_num_batched_tokens)


# kv_cache_dtype values besides "auto", and the torch name of the pool dtype each selects
KV_CACHE_DTYPES: dict[str, str] = {"fp8_e4m3": "float8_e4m3fn"}


def _resolve_kernels(choice: str, device_type: str) -> str:
    if choice != "auto":
        return choice
    return "triton" if device_type == "cuda" else "torch"
