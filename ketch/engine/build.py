"""The composition root: an `EngineConfig` becomes the parts of an engine, wired here and only here.

    config ─▶ ModelSource (path, weight format, tokenizer: resolved once)
           ─▶ the family's config (models/registry) ─▶ max_model_len, EOS ids
           ─▶ TP > 1: the other ranks started (tp_ranks.py; each builds its own runner below)
           ─▶ ModelRunner for rank 0: model ─▶ memory plan ─▶ KV pool ─▶ attention backend ─▶ graphs
              (runner/model_runner.py: the per-rank device side, the same for every rank)
           ─▶ KVCacheManager over that pool (prefix cache, host tier, L3 storage named by the
              model's fingerprint: model_fingerprint.py)
           ─▶ Scheduler over the manager ─▶ gates (grammar compilation, storage prefetch)
           ─▶ speculative decoding (--speculative-algorithm): the proposer and its cost model
           ─▶ PD (--disaggregation-mode prefill|decode): the KV transport over the pool, and the
              prefill side's sends or the decode side's KV arrival gate

Nothing below the engine builds a part of another layer, and nothing else builds these: the
`Engine` takes what `build_engine` returns. A rank-0 failure after the other ranks started
abandons them (they wait in a collective rank 0 will never join) before it re-raises.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ketch.cache.manager import KVCacheManager
from ketch.config import EngineConfig
from ketch.disagg import DisaggConfig, KVTransport, make_transport
from ketch.disagg.fake import FakeHub
from ketch.engine.grammar_gate import GrammarGate
from ketch.engine.kv_arrival_gate import KVArrivalGate
from ketch.engine.pd_prefill import PrefillSends
from ketch.engine.speculation import Speculation
from ketch.engine.model_fingerprint import model_fingerprint
from ketch.engine.storage_gate import StorageGate
from ketch.engine.tp_ranks import TensorParallelRanks
from ketch.models import load_model_config
from ketch.parallel import SINGLE, ParallelContext
from ketch.runner.cpu_dtype import with_cpu_auto_dtype
from ketch.runner.model_runner import ModelRunner
from ketch.scheduler.scheduler import Scheduler
from ketch.spec.block import BlockDraftHead, BlockProposer, block_head_for
from ketch.spec.draft import DraftModelProposer
from ketch.spec.ngram import NgramProposer
from ketch.spec.proposer import Proposer
from ketch.spec.verify_schedule import VerifyCost
from ketch.weights.source import ModelSource


# CUDA: the draft model's KV pool, as a share of the device's memory (an H200: 7 GB, ~220 k tokens
# of a Llama-3.2-1B-shaped draft); the target's memory plan sees it, and the draft's weights, as in use
DRAFT_POOL_FRACTION = 0.05


@dataclass(frozen=True)
class EngineParts:
    config: EngineConfig  # as the engine runs it (CUDA graphs off with TP > 1)
    source: ModelSource
    model_config: Any  # the family's frozen config (models/family.py FamilyConfig)
    max_model_len: int
    eos_ids: tuple[int, ...]
    ranks: TensorParallelRanks | None  # TP > 1: the other ranks
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    grammars: GrammarGate
    storage_gate: StorageGate | None  # an L3 tier: where requests wait for their pages
    transport: KVTransport | None = None  # PD: one per process
    pd_sends: PrefillSends | None = None  # PD prefill: the transfers of first tokens and prompts' KV
    kv_gate: KVArrivalGate | None = None  # PD decode: where requests wait for their prompt's KV
    spec: Speculation | None = None  # speculative decoding: proposer, cost model, counters


def build_engine(config: EngineConfig, eos_token_ids: tuple[int, ...] = (), fake_hub: FakeHub | None = None,
                 parallel: ParallelContext | None = None) -> EngineParts:
    """fake_hub: PD with the fake transport in one process (tests pair a prefill and a decode engine).
    parallel: a DP-attention rank's context (dp_attention.py: the ranks are already joined, and
    each runs an engine of its own); None: TP > 1 starts the other ranks here."""
    if config.torch_device.type == "cuda" and not torch.cuda.is_available():  # before torch asserts it
        raise ValueError(f"device: {config.device!r} was asked for, but torch sees no CUDA device here")
    source = ModelSource.resolve(config.model, config.load_format, config.tokenizer)
    config = with_cpu_auto_dtype(config, source)  # bf16 for 4-bit GGUF weights on any vector CPU
    model_config = load_model_config(source)
    window = getattr(model_config, "sliding_window", None)
    max_model_len = config.max_model_len or min(model_config.max_position_embeddings, window or math.inf)
    if max_model_len > model_config.max_position_embeddings:  # vLLM refuses it too
        raise ValueError(f"max_model_len: {max_model_len} is past the model's max_position_embeddings "
                         f"({model_config.max_position_embeddings}): positions it was never trained on")
    if window and max_model_len > window:
        raise ValueError(f"max_model_len: {max_model_len} is past the model's sliding window ({window} tokens); "
                         f"ketch attends to every earlier token, which is the model's attention only within "
                         f"the window, so its context is at most {window}")
    eos_ids = tuple(dict.fromkeys(model_config.eos_token_ids + tuple(eos_token_ids)))
    ranks = None
    if config.tensor_parallel_size > 1:
        config = _without_graphs(config)
        if parallel is None:
            ranks = TensorParallelRanks(config, model_config, max_model_len, source)
    if parallel is None:
        parallel = ranks.parallel if ranks else SINGLE
    # before the target's runner: on CUDA its memory plan then counts the draft's weights, pool
    # and graphs as in use, and sizes the target's pool from what is left
    draft = _draft_model(config, model_config.vocab_size, max_model_len) \
        if config.speculative_algorithm == "draft" else None
    try:
        runner = ModelRunner(config, model_config, max_model_len, source, parallel)
    except BaseException:
        if ranks:
            ranks.abandon()
        raise
    pd = config.disaggregation_mode != "null"
    fingerprint = model_fingerprint(source, model_config, config) if config.hicache_storage_backend or pd else ""
    kv = KVCacheManager.from_config(runner.pool, config, fingerprint)
    storage_gate = StorageGate(kv) if kv.storage is not None else None
    scheduler = Scheduler(config, kv, storage_gate)
    grammars = GrammarGate(source.tokenizer, model_config.vocab_size, eos_ids, runner.device)
    spec = None
    if config.speculative_algorithm:
        verify_cost = VerifyCost()  # measured by Speculation, read by the block proposer's schedule
        spec = Speculation(config, draft or make_proposer(config, runner, verify_cost), verify_cost)
        runner.keep_hidden = spec.needs_hidden  # the engine hands them to the proposer a step later
    parts = EngineParts(config, source, model_config, max_model_len, eos_ids, ranks, runner, kv, scheduler, grammars,
                        storage_gate, spec=spec)
    return _with_transport(parts, fingerprint, fake_hub) if pd else parts


def make_proposer(config: EngineConfig, runner: ModelRunner, verify_cost: VerifyCost) -> Proposer:
    """The proposers that need no model of their own (`draft`'s is built before the target's runner)."""
    k = config.speculative_num_draft_tokens
    if config.speculative_algorithm == "ngram":
        return NgramProposer(k, config.speculative_ngram_min_match_window_size,
                             config.speculative_ngram_max_match_window_size)
    if config.speculative_algorithm == "block":
        return BlockProposer(_block_head(config, runner), runner.model, k,
                             verify_cost if config.speculative_adaptive else None)
    raise ValueError(f"speculative_algorithm: {config.speculative_algorithm!r} is not built yet")


def _block_head(config: EngineConfig, runner: ModelRunner) -> BlockDraftHead:
    """The draft head over the target's hidden size: random (seeded) or a safetensors file's."""
    head = block_head_for(runner.model_config, config.speculative_num_draft_tokens,
                          config.speculative_draft_model_path, config.seed)
    return head.to(runner.device, runner.dtype).eval()


def _draft_model(config: EngineConfig, vocab_size: int, max_model_len: int) -> DraftModelProposer:
    """The draft model's own runner and KV manager: its dtype is the device's default (on the CPU
    a 4-bit GGUF stays 4-bit in bf16: runner/cpu_dtype.py), pages of one token. Its pool: a
    quarter of the target's KV budget where one is given, else a quarter of `kv_cache_fraction` on
    the CPU and DRAFT_POOL_FRACTION of the device on CUDA; its decode steps replay CUDA graphs when
    the target's do."""
    path = config.speculative_draft_model_path
    assert path is not None  # EngineConfig checked it
    budget = config.kv_cache_memory // 4 if config.kv_cache_memory else None
    if budget is None and config.torch_device.type == "cuda":
        budget = int(torch.cuda.get_device_properties(config.torch_device).total_memory * DRAFT_POOL_FRACTION)
    dc = EngineConfig(model=path, load_format="dummy" if path.endswith(".json") else "auto", device=config.device,
                      seed=config.seed, page_size=1, kv_cache_memory=budget,
                      kv_cache_fraction=config.kv_cache_fraction / 4, max_num_seqs=config.max_num_seqs,
                      cuda_graph=config.use_cuda_graph, cuda_graph_max_bs=config.cuda_graph_max_bs,
                      num_threads=config.num_threads, quantization=config.quantization,
                      attention_backend=config.attention_backend, layer_kernels=config.layer_kernels)
    try:
        source = ModelSource.resolve(dc.model, dc.load_format)
        dc = with_cpu_auto_dtype(dc, source)  # as the target's: bf16 for a 4-bit GGUF on any vector CPU
        model_config = load_model_config(source)
    except ValueError as e:  # the loader names its own field ("model: path ... does not exist")
        reason = str(e).removeprefix("model: ")
        raise ValueError(f"speculative_draft_model_path: {reason}") from None
    if model_config.vocab_size != vocab_size:
        raise ValueError(f"speculative_draft_model_path: the draft's vocab_size {model_config.vocab_size} differs "
                         f"from the target's {vocab_size} (it must share the tokenizer)")
    draft_len = min(max_model_len, model_config.max_position_embeddings)
    runner = ModelRunner(dc, model_config, draft_len, source)
    kv = KVCacheManager(runner.pool)
    return DraftModelProposer(runner, kv, config.speculative_num_draft_tokens, draft_len)


def _with_transport(parts: EngineParts, fingerprint: str, hub: FakeHub | None) -> EngineParts:
    c = parts.config
    t = c.disaggregation_timeout
    disagg = DisaggConfig(c.disaggregation_mode, c.disaggregation_transfer_backend, c.disaggregation_bootstrap_host,
                          c.disaggregation_bootstrap_port, bootstrap_timeout_s=t, waiting_timeout_s=t,
                          transfer_timeout_s=t)
    transport = make_transport(disagg, parts.runner.pool.layers, fingerprint, hub)
    if c.disaggregation_mode == "prefill":
        return dataclasses.replace(parts, transport=transport, pd_sends=PrefillSends(transport, parts.kv))
    # a lone fake decode side receives nothing: its requests run their prompts here (no gate)
    gate = KVArrivalGate(transport, parts.kv, t) if transport.carries_kv else None
    return dataclasses.replace(parts, transport=transport, kv_gate=gate)


def _without_graphs(config: EngineConfig) -> EngineConfig:
    """CUDA graphs with TP > 1 are not built or tested yet: decode runs eagerly, and says so."""
    if not config.use_cuda_graph:
        return config
    print(f"ketch: CUDA graphs are off with tensor_parallel_size={config.tensor_parallel_size} (not supported yet)",
          file=sys.stderr)
    return dataclasses.replace(config, cuda_graph=False)
