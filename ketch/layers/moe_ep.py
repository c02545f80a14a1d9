"""Expert-parallel MoE: the routed experts split across the EP ranks (the TP ranks, ketch/parallel/
expert.py), each rank holding whole experts in its physical slots.

    EPExperts(experts, hidden, intermediate, parallel)
        w13 [S, 2I, H] (gate | up), w2 [S, H, I]: the rank's S = (experts + redundant) / ep_size
        slots, each one whole expert (no intermediate split). The placement: phy2log [ep_size * S]
        (the logical expert in every slot of every rank; slot p on rank p // S), its inverse
        log2phy [experts, most replicas] (-1 padded) and logcnt [experts]. At build slots
        0..E-1 hold experts 0..E-1 (rank r: experts r*E/N ..), the redundant slots after them
        replicas of experts 0, 1, ..; EPLB (eplb_runtime.py) re-places them at run time.
        The loader takes checkpoint tensors of the experts in the rank's slots only (others are
        skipped; `param_shard_ids` lists the rank's experts for the loader's completeness check).
    ExpertParallelMoE(...)   Router (replicated, moe.py) + EPExperts; forward(x [T, H]) -> [T, H]:
        every (token, pick) goes to a physical replica of its expert: replica
        token_index % logcnt[expert] (deterministic; replicas hold the same weights, so the
        choice never changes the output, only where it is computed)
          dispatch "all_reduce" (x the same on every rank): each rank computes the picks its
            slots own, weighted, summed per token; one all-reduce adds the ranks' parts
          dispatch "all_to_all" (x may differ per rank): the picks go to their owners in one
            all_to_all_single (rows and slot ids), the owners run them, the outputs come back in
            a second one, and the sending rank weights and sums them per token
          DP attention with "all_reduce": the ranks' tokens are all-gathered (per-rank counts),
            routed and computed as above, all-reduced, and each rank keeps its own rows
Each step makes host syncs (split sizes), as fused_experts_ref does: no CUDA graph capture.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ketch.layers.activation import silu_and_mul
from ketch.layers.moe import ExpertShard, Router, Select
from ketch.parallel import ParallelContext
from ketch.parallel.collectives import all_gather_rows, all_to_all_rows, exchange_counts, rows_per_rank


def expert_rows(rows: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """rows [N, H], slots [N] (a local slot each) -> each row through its slot's SwiGLU expert,
    [N, H], unweighted; one gate|up and one down GEMM per slot with rows."""
    out = rows.new_empty(rows.shape[0], w2.shape[1])
    if rows.shape[0] == 0:
        return out
    order = slots.argsort(stable=True)
    counts = torch.bincount(slots, minlength=w13.shape[0]).tolist()
    grouped = rows[order]
    start = 0
    for slot, n in enumerate(counts):
        if n:
            part = grouped[start : start + n]
            out[order[start : start + n]] = F.linear(silu_and_mul(F.linear(part, w13[slot])), w2[slot])
            start += n
    return out


def initial_placement(num_experts: int, num_slots: int) -> torch.Tensor:
    """phy2log at build: every expert once in order, then replicas of experts 0, 1, .."""
    return torch.arange(num_slots, dtype=torch.int64) % num_experts


class EPExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_experts = num_experts
        total = num_experts + parallel.ep.num_redundant
        if total % parallel.world_size:
            raise ValueError(f"ep_num_redundant_experts: {num_experts} experts + {parallel.ep.num_redundant} "
                             f"redundant do not split evenly over ep_size {parallel.world_size}")
        self.local_slots = total // parallel.world_size
        self.first_slot = parallel.rank * self.local_slots
        self.intermediate = intermediate_size
        self.w13 = nn.Parameter(torch.empty(self.local_slots, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.local_slots, hidden_size, intermediate_size))
        self.set_maps(initial_placement(num_experts, total))

    # --- the placement ---------------------------------------------------------------------------
    def set_maps(self, phy2log: torch.Tensor) -> None:
        """Adopt `phy2log` (every rank's slots) and derive log2phy / logcnt; moves no weights."""
        phy2log = phy2log.to(torch.int64).cpu()
        if phy2log.shape != (self.local_slots * self.parallel.world_size,):
            raise ValueError(f"placement of {tuple(phy2log.shape)} slots, expected {self.local_slots} per rank")
        logcnt = torch.bincount(phy2log, minlength=self.num_experts)
        if logcnt.shape[0] != self.num_experts or not bool((logcnt > 0).all()):
            raise ValueError("placement: every expert needs at least one slot")
        log2phy = torch.full((self.num_experts, int(logcnt.max())), -1, dtype=torch.int64)
        for expert in range(self.num_experts):
            slots = (phy2log == expert).nonzero().flatten()
            log2phy[expert, : slots.numel()] = slots
        device = self.w13.device
        self.register_buffer("phy2log", phy2log.to(device), persistent=False)
        self.register_buffer("log2phy", log2phy.to(device), persistent=False)
        self.register_buffer("logcnt", logcnt.to(device), persistent=False)

    def local_experts(self) -> list[int]:
        """The logical expert in each of this rank's slots."""
        return self.phy2log[self.first_slot : self.first_slot + self.local_slots].tolist()

    def route(self, ids: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [P] of picks made by tokens `token` [P] -> the physical slot of each:
        replica token % logcnt[expert]."""
        return self.log2phy[ids, token % self.logcnt[ids]]

    # --- loading ---------------------------------------------------------------------------------
    def param_shard_ids(self, param_name: str) -> tuple[ExpertShard, ...]:
        parts = ("w2",) if param_name == "w2" else ("w1", "w3")
        return tuple((e, p) for e in sorted(set(self.local_experts())) for p in parts)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ExpertShard) -> None:
        """One expert's full gate / up [I, H] or down [H, I], copied into every local slot that
        holds that expert; an expert this rank does not hold is skipped."""
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"names expert {expert}, the layer has {self.num_experts}")
        if (part == "w2") != (param is self.w2) or part not in ("w1", "w2", "w3"):
            raise ValueError(f"shard {part!r} does not belong in this parameter")
        n = self.intermediate
        for slot, held in enumerate(self.local_experts()):
            if held != expert:
                continue
            dst = param.data[slot] if part == "w2" else param.data[slot].narrow(0, 0 if part == "w1" else n, n)
            if loaded.shape != dst.shape:
                raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(loaded)


class ExpertParallelMoE(nn.Module):
    """gate + expert-parallel experts; forward(x [T, H]) -> [T, H]: this rank's tokens' whole output."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, select: Select, *,
                 parallel: ParallelContext, correction_bias: bool = False, fp32_router_logits: bool = False) -> None:
        super().__init__()
        if not parallel.ep.enabled:
            raise ValueError("ExpertParallelMoE needs ep_size > 1 (ketch/layers/moe.py is the TP MoE)")
        self.gate = Router(hidden_size, num_experts, select, correction_bias=correction_bias,
                           fp32_logits=fp32_router_logits)
        self.experts = EPExperts(num_experts, hidden_size, intermediate_size, parallel)
        self.parallel = parallel
        self.all_to_all = parallel.ep.dispatch == "all_to_all"
        self.gather = parallel.ep.dp_attention and not self.all_to_all
        # each rank's router saw only its own tokens: the load is summed over ranks (EPLB)
        self.load_is_partial = parallel.ep.dp_attention and self.all_to_all

    def forward(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """first: never given (no first_product)."""
        if self.gather:
            counts = rows_per_rank(self.parallel, x.shape[0], x.device)
            start = sum(counts[: self.parallel.rank])
            everyone = all_gather_rows(self.parallel, x, counts)
            weights, ids = self.gate(everyone)
            y = self.parallel.all_reduce(self._local_part(everyone, weights, ids))
            return y[start : start + x.shape[0]]
        weights, ids = self.gate(x)
        if self.all_to_all:
            return self._exchange(x, weights, ids)
        return self.parallel.all_reduce(self._local_part(x, weights, ids))

    def _picks(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token of each (token, pick) row, its physical slot), rows in (token, pick) order."""
        tokens, k = ids.shape
        token = torch.arange(tokens, device=ids.device).repeat_interleave(k)
        return token, self.experts.route(ids.reshape(-1), token)

    def _local_part(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weighted sum, per token, of the picks this rank's slots own ([T, H], 0 elsewhere)."""
        token, slot = self._picks(ids)
        e = self.experts
        mine = (slot >= e.first_slot) & (slot < e.first_slot + e.local_slots)
        token = token[mine]
        y = expert_rows(x[token], slot[mine] - e.first_slot, e.w13, e.w2)
        y *= weights.reshape(-1)[mine].to(x.dtype).unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token, y)

    def _exchange(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """All-to-all dispatch: picks to the ranks owning their slots and their outputs back."""
        token, slot = self._picks(ids)
        e, p = self.experts, self.parallel
        owner = slot // e.local_slots
        order = owner.argsort(stable=True)
        send = torch.bincount(owner, minlength=p.world_size).tolist()
        recv = exchange_counts(p, send, x.device)
        token, slot = token[order], slot[order]
        rows = all_to_all_rows(p, x[token], send, recv)
        slots = all_to_all_rows(p, slot % e.local_slots, send, recv)
        back = all_to_all_rows(p, expert_rows(rows, slots, e.w13, e.w2), recv, send)
        back *= weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token, back)
