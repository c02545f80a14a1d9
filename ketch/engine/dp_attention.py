"""DP attention in the engine (`--enable-dp-attention`, with `--tp N --ep-size N`): N engines, one
per rank, each with its own scheduler, KV pool and prefix cache over its own requests, whose
forwards meet in the MoE layers (attention, dense MLPs, embedding and LM head run whole on each
rank over its own tokens; the routed experts are split over the ranks: ketch/parallel/expert.py).

    engine process (rank 0): DPAttentionEngine ── the Engine API (add_request, step, abort,
      │                      stats, ...) over rank 0's own Engine and the other ranks'
      ├── ketch-rank1 (run_dp_rank: an Engine of its own)
      └── ...

A request goes to the rank with the fewest unfinished requests (ties in turn) and stays there.
`step()` is one tick (dp_tick.py): the new requests and aborts go out, every rank steps (an idle
one runs a forward over zero tokens, so the collectives meet), the outputs come back. Rank 0
checks every request before it hands it out, so bad input raises here as with one engine.
Requests finish, abort and return their pages on their own rank; /metrics sums the ranks.

Not with it (config_checks.py refuses them with TP > 1 already): PD, speculation, the
hierarchical cache. CUDA graphs are off, as with TP.
"""
from __future__ import annotations

import atexit
import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ketch.config import EngineConfig
from ketch.engine.dp_tick import ControlLink, Reply, Tick, serve_tick
from ketch.engine.engine import AUDIT_INTERVAL_S, Engine
from ketch.engine.messages import Bootstrap
from ketch.engine.outputs import EngineOutput, EngineStats
from ketch.engine.rank_procs import RankProcesses
from ketch.engine.tp_ranks import check_no_group, init_rank, rank0_store, rank_config, rank_store
from ketch.models import load_model_config
from ketch.sampling.params import SamplingParams
from ketch.weights.source import ModelSource


def run_dp_rank(config: EngineConfig, eos_token_ids: tuple[int, ...], rank: int, port: int) -> None:
    """Rank r > 0: its engine serves rank 0's ticks until "shutdown" (or until rank 0 is gone:
    a collective with a closed peer raises, which ends the process)."""
    parallel = init_rank(config, rank, rank_store(config, port))
    link = ControlLink()  # right after the model's group, on every rank
    engine = Engine(rank_config(config, rank), eos_token_ids, parallel=parallel)
    while (tick := link.receive()).op != "shutdown":
        link.gather(serve_tick(engine, tick, link))
    dist.destroy_process_group()


class DPAttentionEngine:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...] = ()) -> None:
        check_no_group()
        source = ModelSource.resolve(config.model, config.load_format, config.tokenizer)
        if not getattr(load_model_config(source), "num_experts", 0):
            raise ValueError("enable_dp_attention: the model has no routed experts (DP attention splits a MoE "
                             "model's experts over the ranks); run replicas behind `ketch gateway` instead")
        n, store = config.tensor_parallel_size, rank0_store(config)
        self._ranks = RankProcesses(run_dp_rank, lambda r: (config, eos_token_ids, r, store.port), n, "DP-attention")
        atexit.register(self.close)  # before multiprocessing's exit hook terminates the ranks
        try:
            parallel = init_rank(config, 0, store)
            self._link = ControlLink()
            self.local = Engine(rank_config(config, 0), eos_token_ids, parallel=parallel)
        except BaseException:
            self._ranks.kill()  # they wait for a rank 0 that will not come
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        self.config, self.runner = self.local.config, self.local.runner
        self.model_config, self.max_model_len, self.eos_ids = self.local.model_config, self.local.max_model_len, \
            self.local.eos_ids
        self.requests: dict[str, int] = {}  # unfinished request id -> its rank
        self._left: dict[str, int] = {}  # ... -> its samples not yet finished
        self._load = [0] * n  # unfinished requests per rank
        self._turn = itertools.cycle(range(n))
        self._adds: list[list[tuple]] = [[] for _ in range(n)]
        self._aborts: list[list[tuple[str, int | None]]] = [[] for _ in range(n)]
        self._unfinished = [False] * n  # each rank's last answer (rank 0's is read live)
        self._steps = self._audited_steps = 0
        self._audited_at = 0.0

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    generated_token_ids: Sequence[int] = (), bootstrap: Bootstrap | None = None) -> None:
        if bootstrap is not None:
            raise ValueError("bootstrap: PD disaggregation does not run with DP attention")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.local.validate(request_id, prompt_ids, params, generated_token_ids)
        rank = self._pick()
        self._adds[rank].append((request_id, list(prompt_ids), params, list(generated_token_ids)))
        self.requests[request_id], self._left[request_id] = rank, params.n
        self._load[rank] += 1

    def abort(self, request_id: str, index: int | None = None) -> None:
        rank = self.requests.get(request_id)
        if rank is not None:  # after its add, if that has not gone out yet: a tick applies adds first
            self._aborts[rank].append((request_id, index))

    def has_unfinished(self) -> bool:
        return (any(self._adds) or any(self._aborts) or self.local.has_unfinished()
                or any(self._unfinished[1:]))

    def step(self) -> list[EngineOutput]:
        tick = Tick("step", self._adds, self._aborts)
        n = len(self._load)
        self._adds, self._aborts = [[] for _ in range(n)], [[] for _ in range(n)]
        replies = self._tick(tick)
        self._steps += 1
        self._unfinished = [r.unfinished for r in replies]
        outputs = [o for r in replies for o in r.outputs]
        for o in outputs:
            if o.finished and o.request_id in self._left:
                self._left[o.request_id] -= 1
                if not self._left[o.request_id]:
                    del self._left[o.request_id]
                    self._load[self.requests.pop(o.request_id)] -= 1
        return outputs

    # ---------------------------------------------------------------- the ranks' state
    def stats(self) -> EngineStats:
        """Counts summed over the ranks; the MoE counters are rank 0's (every rank routes every token)."""
        return merge_stats([r.value for r in self._tick(Tick("stats"))])

    def flush_cache(self) -> dict[str, int]:
        freed: dict[str, int] = {}
        for r in self._tick(Tick("flush")):
            for tier, pages in r.value.items():
                freed[tier] = freed.get(tier, 0) + pages
        return freed

    def check_invariants(self) -> None:
        failed = [r.value for r in self._tick(Tick("check")) if r.value]
        assert not failed, "; ".join(failed)

    def audit_if_due(self) -> None:
        now = time.monotonic()
        if self._steps != self._audited_steps and now - self._audited_at >= AUDIT_INTERVAL_S:
            self._audited_at, self._audited_steps = now, self._steps
            self._tick(Tick("audit"))

    def close(self) -> None:
        """Stop the other ranks and wait for them; idempotent."""
        if self._ranks.closing or not dist.is_initialized():
            return
        self._ranks.closing = True
        try:
            self._link.send(Tick("shutdown"))
        except RuntimeError:
            pass  # a rank is already gone: nothing to tell
        self._ranks.join()
        self.local.close()
        dist.destroy_process_group()

    def _pick(self) -> int:
        """The rank with the fewest unfinished requests; ties in turn."""
        least = min(self._load)
        return next(r for r in self._turn if self._load[r] == least)

    def _tick(self, tick: Tick) -> list[Reply]:
        self._link.send(tick)
        replies = self._link.gather(serve_tick(self.local, tick, self._link))
        assert replies is not None
        return replies


def merge_stats(per_rank: list[EngineStats]) -> EngineStats:
    """Numbers and tuples of numbers summed, flags or-ed; names and the MoE counters rank 0's."""
    merged: dict[str, Any] = {}
    for name in EngineStats.__struct_fields__:
        values = [getattr(s, name) for s in per_rank]
        first = values[0]
        if name.startswith("moe_") or isinstance(first, str):
            merged[name] = first
        elif isinstance(first, bool):
            merged[name] = any(values)
        elif isinstance(first, tuple):
            merged[name] = tuple(map(sum, zip(*values)))
        else:
            merged[name] = sum(values)
    return EngineStats(**merged)
