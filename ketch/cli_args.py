"""Engine and sampling flags shared by every `ketch` subcommand."""
from __future__ import annotations

import argparse
from typing import Any

from ketch.config import CPU_ACTIVATIONS, DISAGGREGATION_MODES, HICACHE_IO_BACKENDS, HICACHE_STORAGE_BACKENDS, SPECULATIVE_ALGORITHMS
from ketch.sampling.params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file, HF directory or config.json (dummy); default: bundled SmolLM2-135M-Instruct")
    g.add_argument("--tokenizer", default=None,
                   help="a GGUF file or HF directory whose tokenizer to use (e.g. real text for a dummy model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "hf", "dummy"])
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                   help="KV pool element type; fp8_e4m3: half of bf16's bytes, scale 1.0 (auto: the model dtype)")
    g.add_argument("--kv-cache-fraction", type=float, default=0.05, help="CPU: KV pool as a fraction of the memory")
    g.add_argument("--mem-fraction-static", type=float, default=0.9,
                   help="CUDA: fraction of the GPU's total memory for weights + KV pool (the pool also "
                        "leaves the measured room for decode graphs and the largest step)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", "--max-running-requests", dest="max_num_seqs", type=int, default=256,
                   help="sequences the engine runs at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--chunked-prefill-size", type=int, default=None)
    g.add_argument("--disable-prefix-cache", action="store_true")
    g.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"])
    g.add_argument("--num-threads", type=int, default=None)
    graph = g.add_mutually_exclusive_group()
    graph.add_argument("--cuda-graph", action="store_true", help="require CUDA graphs for decode steps (the CUDA default)")
    graph.add_argument("--disable-cuda-graph", action="store_true", help="CUDA: run decode steps eagerly")
    g.add_argument("--cpu-compile", choices=("on", "off"), default="off",
                   help="CPU: decode steps (<= 32 requests) as one torch.compile'd graph per padded batch size")
    g.add_argument("--cuda-graph-max-bs", type=int, default=256, help="largest decode batch replayed as a CUDA graph")
    overlap = g.add_mutually_exclusive_group()
    overlap.add_argument("--overlap-schedule", action="store_true",
                         help="schedule step N+1 while step N runs (the CUDA default)")
    overlap.add_argument("--disable-overlap-schedule", action="store_true",
                         help="process each step's tokens before scheduling the next")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: triton on CUDA, torch on the CPU")
    g.add_argument("--layer-kernels", default="auto", choices=["auto", "torch", "triton", "native"],
                   help="RMSNorm/RoPE/SiLU kernels; auto: fused triton on CUDA, ketch's C ops on the CPU "
                        "(bf16 models; torch for fp32)")
    g.add_argument("--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=int, default=1,
                   help="ranks the model is split over (rank 0 in the engine, the rest spawned; gloo on CPU, nccl on CUDA)")
    g.add_argument("--ep-size", "--ep", dest="ep_size", type=int, default=1,
                   help="MoE models: split whole experts over the tensor-parallel ranks (1 or the TP size)")
    g.add_argument("--enable-dp-attention", action="store_true",
                   help="MoE models, with --tp N --ep-size N: an engine per rank over its own requests "
                        "(attention data-parallel), the experts split over the ranks")
    g.add_argument("--ep-num-redundant-experts", type=int, default=0, help="EPLB: extra slots for hot experts' replicas")
    g.add_argument("--enable-eplb", action="store_true", help="re-place experts from their measured load (needs --ep-size)")
    g.add_argument("--eplb-rebalance-num-iterations", type=int, default=1000, help="EPLB: forward steps between re-placements")
    g.add_argument("--enable-expert-distribution-metrics", action="store_true",
                   help="/metrics: tokens routed to each expert of each MoE layer (layers x experts series)")
    g.add_argument("--quantization", default="auto", choices=["auto", "none"],
                   help="auto: on a bf16 CPU run, keep a GGUF's 4-bit matrices 4-bit for small-batch decode")
    g.add_argument("--cpu-activations", default="int16", choices=CPU_ACTIVATIONS,
                   help="CPU 4-bit product: activations rounded to int16 per block of 32 (default), or to "
                        "int8 as llama.cpp does (~1.9x less arithmetic, lower fidelity to fp32)")
    g.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="keep KV pages evicted from the device in a host-memory pool (L2) and load them back on a hit")
    g.add_argument("--hicache-ratio", type=float, default=2.0, help="host pool size as a multiple of the device pool")
    g.add_argument("--hicache-size", type=float, default=None, help="host pool size in GB (overrides --hicache-ratio)")
    g.add_argument("--hicache-write-policy", default="write_through", choices=["write_through", "write_back"],
                   help="copy pages to the host when cached (write_through) or when evicted from the device (write_back)")
    g.add_argument("--hicache-io-backend", default="kernel", choices=list(HICACHE_IO_BACKENDS),
                   help="fragmented host<->device page copies: direct (gather, then DMA) or kernel "
                        "(GPU kernels over the pinned host pool, no host gather)")
    g.add_argument("--hicache-storage-backend", default=None, choices=list(HICACHE_STORAGE_BACKENDS),
                   help="L3 storage below the host pool: pages written in the background, prefetched at admission")
    g.add_argument("--hicache-storage-url", default=None,
                   help="file:///dir (default: $XDG_CACHE_HOME/ketch/kv or ~/.cache/ketch/kv) or "
                        "redis://host:port[/db] (default: redis://127.0.0.1:6379/0) or "
                        "mooncake://master-host:port[?global_segment_mb=N&local_buffer_mb=N&timeout_ms=N"
                        "&local_hostname=HOST] (default: mooncake://127.0.0.1:50051)")
    g.add_argument("--hicache-prefetch-timeout", type=float, default=1.0,
                   help="seconds a request waits at admission for its pages from L3 (then uses what arrived)")
    g.add_argument("--hicache-storage-write-queue", type=int, default=1024,
                   help="pages waiting to be written to L3 at most (a full queue drops writes, counted)")

    pd = p.add_argument_group("PD disaggregation (ketch/disagg/README.md; SGLang's flags)")
    pd.add_argument("--disaggregation-mode", default="null", choices=list(DISAGGREGATION_MODES),
                    help="null: colocated; prefill: run prompts and send their KV + first token to a decode "
                         "server; decode: receive them and decode (requests carry bootstrap_host/port/room)")
    pd.add_argument("--disaggregation-transfer-backend", default="tcp", choices=["tcp", "nixl", "mooncake", "fake"],
                    help="how KV pages move: tcp (the reference, no extra package), nixl (NIXL over UCX), "
                         "mooncake (the Mooncake transfer engine, tcp transport, P2P handshake: no etcd), "
                         "fake (moves no bytes; a decode server runs each prompt itself: flow tests and warm-up)")
    pd.add_argument("--disaggregation-bootstrap-host", default="127.0.0.1",
                    help="prefill: the address its bootstrap server binds (decode servers reach it there)")
    pd.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                    help="prefill: its bootstrap server's port (0: any free port)")
    pd.add_argument("--disaggregation-timeout", type=float, default=300.0,
                    help="seconds for each of: the two sides finding each other, the KV starting to move, all of it there")

    sp = p.add_argument_group("speculative decoding (ketch/spec/README.md; SGLang's flags)")
    sp.add_argument("--speculative-algorithm", default=None, choices=[a.upper() for a in SPECULATIVE_ALGORITHMS]
                    + list(SPECULATIVE_ALGORITHMS), type=str,
                    help="verify proposed tokens each decode step; output unchanged. ngram: prompt lookup "
                         "over the request's own tokens; draft: a smaller model; block: a draft head on the "
                         "target's hidden state, k tokens in one pass, confidence-scheduled verify")
    sp.add_argument("--speculative-num-draft-tokens", type=int, default=4, help="most draft tokens verified per step")
    sp.add_argument("--speculative-draft-model-path", default=None,
                    help="draft: a smaller model, same tokenizer; block: the draft head's .safetensors (default: random)")
    sp.add_argument("--speculative-ngram-min-match-window-size", type=int, default=1,
                    help="ngram: the shortest suffix that may match earlier tokens")
    sp.add_argument("--speculative-ngram-max-match-window-size", type=int, default=12,
                    help="ngram: the longest suffix tried")
    sp.add_argument("--speculative-adaptive", choices=("on", "off"), default="on",
                    help="on: speculate only at batch sizes where measured verify steps beat plain ones (block: "
                         "and verify only the positions whose confidence pays for their rows)")


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=a.model, tokenizer=a.tokenizer, dtype=a.dtype, device=a.device, load_format=a.load_format, page_size=a.page_size,
        kv_cache_memory=a.kv_cache_memory, kv_cache_dtype=a.kv_cache_dtype, kv_cache_fraction=a.kv_cache_fraction,
        mem_fraction_static=a.mem_fraction_static, max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        chunked_prefill_size=a.chunked_prefill_size, enable_prefix_cache=not a.disable_prefix_cache,
        schedule_policy=a.schedule_policy, num_threads=a.num_threads, quantization=a.quantization,
        cpu_activations=a.cpu_activations,
        cuda_graph=True if a.cuda_graph else (False if a.disable_cuda_graph else None),
        overlap_schedule=True if a.overlap_schedule else (False if a.disable_overlap_schedule else None),
        cuda_graph_max_bs=a.cuda_graph_max_bs, cpu_compile=a.cpu_compile == "on",
        attention_backend=a.attention_backend, layer_kernels=a.layer_kernels,
        tensor_parallel_size=a.tensor_parallel_size, ep_size=a.ep_size, enable_dp_attention=a.enable_dp_attention,
        ep_num_redundant_experts=a.ep_num_redundant_experts, enable_eplb=a.enable_eplb,
        eplb_rebalance_num_iterations=a.eplb_rebalance_num_iterations,
        enable_expert_distribution_metrics=a.enable_expert_distribution_metrics,
        enable_hierarchical_cache=a.enable_hierarchical_cache,
        hicache_ratio=a.hicache_ratio, hicache_size=a.hicache_size, hicache_write_policy=a.hicache_write_policy,
        hicache_io_backend=a.hicache_io_backend,
        hicache_storage_backend=a.hicache_storage_backend, hicache_storage_url=a.hicache_storage_url,
        hicache_prefetch_timeout=a.hicache_prefetch_timeout, hicache_storage_write_queue=a.hicache_storage_write_queue,
        disaggregation_mode=a.disaggregation_mode, disaggregation_transfer_backend=a.disaggregation_transfer_backend,
        disaggregation_bootstrap_host=a.disaggregation_bootstrap_host,
        disaggregation_bootstrap_port=a.disaggregation_bootstrap_port, disaggregation_timeout=a.disaggregation_timeout,
        speculative_algorithm=a.speculative_algorithm and a.speculative_algorithm.lower(),
        speculative_num_draft_tokens=a.speculative_num_draft_tokens,
        speculative_draft_model_path=a.speculative_draft_model_path,
        speculative_ngram_min_match_window_size=a.speculative_ngram_min_match_window_size,
        speculative_ngram_max_match_window_size=a.speculative_ngram_max_match_window_size,
        speculative_adaptive=a.speculative_adaptive == "on",
    )


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop,
    )
