"""GPU memory plan: how many KV pages fit once the weights, the decode graphs and the largest
eager step have their memory (EngineConfig.mem_fraction_static).

    device: | in use after load | KV pool | graphs + largest eager step | margin | rest |
              weights, CUDA context,         measured before the pool
              other processes                exists (`profile_peak`)

The pool gets the smaller of
    fraction cap: total * mem_fraction_static - in use after load   (SGLang's meaning)
    measured:     free after profiling - measured peak - margin
The peak is measured before the pool exists (`profile_peak`): the graphs bake the pool's
addresses in, so the real ones can only be captured after it is allocated. The profile
runs the same code on a one-page scratch pool, reads what the device lost, then frees it all.

`plan_kv_pool` is the arithmetic (pure, tested on the CPU); `profile_peak` needs CUDA.
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ketch.forward_batch import ForwardBatch, SeqChunk
from ketch.cache.kv_pool import KVPool
from ketch.config import EngineConfig
from ketch.models.family import FamilyConfig
from ketch.models.registry import family_for

# Not profiled: sampling's sorts over [rows, vocab], allocator fragmentation across step shapes,
# the torch backend's lazily captured graphs. 1 GiB is ~0.7 % of an H200.
SAFETY_MARGIN = 1 << 30
GiB = float(1 << 30)


@dataclass(frozen=True)
class Profile:
    """Device bytes the profile took: the largest eager step, then that plus the decode graphs."""

    step: int
    peak: int

    @property
    def graphs(self) -> int:
        return self.peak - self.step


@dataclass(frozen=True)
class MemoryPlan:
    total: int  # device bytes
    used_after_load: int  # weights, CUDA context, other processes
    free: int  # free when the pool is sized (after the profile was freed)
    peak: int  # measured: graphs + largest eager step
    margin: int
    num_pages: int
    page_bytes: int
    bound: str  # what sized the pool: "kv_cache_memory" | "mem_fraction_static" | "measured"
    profile: Profile | None = None  # the measurement behind `peak` (None: not profiled)

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def describe(self) -> str:
        text = (f"KV pool: {self.num_pages} pages, {self.pool_bytes / GiB:.2f} GiB (bound: {self.bound}); "
                f"device {self.total / GiB:.1f} GiB, in use after load {self.used_after_load / GiB:.2f} GiB")
        if self.profile is not None:
            text += (f", measured largest eager step {self.profile.step / GiB:.2f} GiB + decode graphs "
                     f"{self.profile.graphs / GiB:.2f} GiB, margin {self.margin / GiB:.2f} GiB")
        return text


def check_fraction(value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {value}")


def plan_kv_pool(*, total: int, used_after_load: int, free: int, peak: int, mem_fraction_static: float,
                 page_bytes: int, kv_cache_memory: int | None = None, margin: int = SAFETY_MARGIN) -> MemoryPlan:
    """Whole pages for the pool. kv_cache_memory (explicit bytes) wins over both bounds."""
    check_fraction(mem_fraction_static)
    if page_bytes < 1:
        raise ValueError(f"page_bytes must be >= 1, got {page_bytes}")
    if kv_cache_memory:
        budget, bound = kv_cache_memory, "kv_cache_memory"
    else:
        cap = int(total * mem_fraction_static) - used_after_load
        measured = free - peak - margin
        budget, bound = (cap, "mem_fraction_static") if cap <= measured else (measured, "measured")
        if budget < page_bytes:
            raise ValueError(
                f"mem_fraction_static={mem_fraction_static}: no room for a KV pool; of {total / GiB:.2f} GiB, "
                f"{used_after_load / GiB:.2f} GiB are in use after load, {free / GiB:.2f} GiB free, and the "
                f"graphs + largest step need {peak / GiB:.2f} GiB (+{margin / GiB:.2f} GiB margin); raise "
                f"mem_fraction_static, or lower max_num_batched_tokens / cuda_graph_max_bs / max_num_seqs")
    return MemoryPlan(total=total, used_after_load=used_after_load, free=free, peak=peak, margin=margin,
                      num_pages=budget // page_bytes, page_bytes=page_bytes, bound=bound)


def profile_step_lens(max_num_batched_tokens: int, max_num_seqs: int, prefill_chunk: int) -> list[int]:
    """New tokens per sequence of the largest step the scheduler can build: as many sampling
    rows as it allows, the token budget filled by prefill chunks of at most `prefill_chunk`,
    the other rows decodes. Decode-like (1-token) chunks first, as the backends require."""
    rows = min(max_num_seqs, max_num_batched_tokens)
    n_prefill = min(rows, -(-max_num_batched_tokens // prefill_chunk))
    n_decode = rows - n_prefill
    tokens = min(max_num_batched_tokens - n_decode, n_prefill * prefill_chunk)  # >= n_prefill
    base, extra = divmod(tokens, n_prefill)
    return sorted([1] * n_decode + [base + (i < extra) for i in range(n_prefill)])


def _device_taken(free0: int, device: torch.device) -> int:
    """Bytes the device lost since free0, plus any the allocator reserved and already released."""
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    released = torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)
    return free0 - free + released


@torch.inference_mode()
def run_largest_step(model: torch.nn.Module, attn: Any, lens: list[int], page_size: int,
                     device: torch.device) -> torch.Tensor:
    """One eager forward of `lens` from position 0; every page is page 0 of the scratch pool
    (the writes collide there, which costs nothing and reads nothing real)."""
    seqs = [SeqChunk(0, n, [0] * -(-n // page_size)) for n in lens]
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    ids = torch.zeros_like(positions)
    hidden = model(ids, positions, attn, attn.init_metadata(ForwardBatch.build(seqs, page_size)))
    rows = torch.tensor(lens, device=device).cumsum(0) - 1  # every sequence samples
    return model.compute_logits(hidden.index_select(0, rows))


def profile_peak(model: torch.nn.Module, config: EngineConfig, model_config: FamilyConfig, max_model_len: int,
                 build_graphs: Callable[[Any], Any] | None) -> Profile:
    """CUDA only. Measure the largest eager step and the decode graphs (`build_graphs(attn)`
    captures them against `attn`) on a one-page scratch pool, then free all of it."""
    device, cfg = config.torch_device, model_config
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free0, _ = torch.cuda.mem_get_info(device)
    family = family_for(cfg.architecture)
    pool = KVPool(family.kv_spec(cfg, model.parallel), 1, config.page_size, config.kv_torch_dtype, device,
                  compute_dtype=config.torch_dtype)
    attn = family.make_attention(cfg, pool, backend=config.resolved_attention_backend, parallel=model.parallel,
                                 device=device, max_model_len=max_model_len)  # the runner's, on the scratch pool
    # no sequence is longer than max_model_len (nor has rotary rows past it)
    chunk = min(config.prefill_chunk, max_model_len)
    lens = profile_step_lens(config.max_num_batched_tokens, config.max_num_seqs, chunk)
    logits = run_largest_step(model, attn, lens, config.page_size, device)
    step = _device_taken(free0, device)
    graphs = build_graphs(attn) if build_graphs is not None else None
    peak = _device_taken(free0, device)
    del logits, graphs, attn, pool
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return Profile(step=step, peak=peak)


def plan_gpu_pool(model: torch.nn.Module, config: EngineConfig, model_config: FamilyConfig, max_model_len: int,
                  build_graphs: Callable[[Any], Any] | None) -> MemoryPlan:
    """CUDA only, after the weights load and before the pool exists. An explicit
    kv_cache_memory skips the profile (the caller has chosen the size)."""
    device, cfg = config.torch_device, model_config
    spec = family_for(cfg.architecture).kv_spec(cfg, model.parallel)  # this rank's share
    page_bytes = spec.bytes_per_page(config.page_size, config.kv_torch_dtype, config.torch_dtype)
    torch.cuda.empty_cache()  # blocks freed during loading are free, not torch's cache
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    profile = None
    if not config.kv_cache_memory:
        profile = profile_peak(model, config, model_config, max_model_len, build_graphs)
        free, _ = torch.cuda.mem_get_info(device)
    plan = plan_kv_pool(total=total, used_after_load=used, free=free, peak=profile.peak if profile else 0,
                        mem_fraction_static=config.mem_fraction_static, page_bytes=page_bytes,
                        kv_cache_memory=config.kv_cache_memory)
    return replace(plan, profile=profile)
