"""Sparse mixture of experts: a router picks k experts per token, each expert is a SwiGLU MLP,
the token's output is the routing-weighted sum of its experts' outputs.

    Router(hidden, experts, select)   the gate: logits = x @ W^T ([experts, hidden], replicated),
                                      then `select(logits)` -> (weights, ids) (moe_routing.py);
                                      optional fp32 logits and DeepSeek's
                                      `e_score_correction_bias` (handed to select); the
                                      product is the layer ops' `linear` (MoE passes it)
    FusedExperts(experts, hidden, intermediate, shared=S)
                                      w13 [E + S, 2 I_r, H] (gate_r | up_r, as the dense
                                      MergedColumnParallelLinear stacks them) and w2 [E + S, H, I_r]:
                                      each rank holds its slice of every expert's intermediate
                                      features (TP by intermediate size, no expert parallelism);
                                      slots E.. hold a shared MLP of S x I features cut into S
                                      experts (DeepSeek's shared experts run in the fused MoE as
                                      experts every token picks, weight 1: one weight stream and
                                      no separate MLP launches at decode)
    MoE(..., ops=)                    gate + experts; forward(x [T, H]) -> [T, H], all-reduced
                                      once across ranks (as the dense row-parallel down_proj);
                                      the expert computation is picked at build from the
                                      LayerOps: `ops.fused_experts` (triton_ops: the fused MoE
                                      kernel, ketch/kernels/fused_moe.py) or `torch_experts`
    fused_experts_ref(x, w13, w2, topk_weights, topk_ids)
                                      the torch reference: the (token, pick) rows sorted by
                                      expert, one gate|up and one down GEMM per expert that has
                                      rows, SiLU·mul between, weighted sum back per token
    dense_experts_ref(...)            the same without host syncs (every expert on every token,
                                      weight 0 where not picked): what MoE runs while a CUDA graph
                                      is captured (decode graphs); untested on a GPU so far

Checkpoint tensors arrive one expert and one projection at a time: shard ids (expert, "w1")
(gate), (expert, "w3") (up) into w13, (expert, "w2") (down) into w2 (Mixtral's own names;
ketch/models/param_loader.py `expert_name_map` maps a family's names onto them). With TP=1
the math is the unsharded one: no reduce, the whole intermediate size in one slot.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ketch.layers.activation import silu_and_mul
from ketch.layers.ops import TORCH_OPS, FirstProduct, LayerOps
from ketch.layers.sharding import load_shard
from ketch.parallel import SINGLE, ParallelContext

Select = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (logits[, correction_bias=]) -> (weights, ids)
ExpertShard = tuple[int | str, str]  # (expert or SHARED, "w1" | "w3" | "w2")


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights / topk_ids [T, k] -> [T, H] in x's
    dtype. The weights multiply in x's dtype; each token's k rows are summed in pick order (a
    scatter and a sum: index_add_ is slow on the CPU)."""
    tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)  # (token, pick) rows grouped by expert, tokens in order
    token_of = order // k
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = x[token_of]
    out = torch.empty(rows.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            part = rows[start : start + n]
            out[start : start + n] = F.linear(silu_and_mul(F.linear(part, w13[expert])), w2[expert])
            start += n
    out *= topk_weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    picks = torch.empty_like(out)
    picks[order] = out  # back to (token, pick) order: each token's k rows side by side
    return picks.view(tokens, k, w2.shape[1]).sum(dim=1)


def dense_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_experts_ref's result without reading anything back to the host (CUDA graph capture):
    every expert runs on every token, weighted by the token's routing weight for it (0 when
    not picked). E / k times the FLOPs; a decode batch reads every expert's weights either way
    once it is large enough to hit them all."""
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=x.dtype, device=x.device)
    dense.scatter_(1, topk_ids, topk_weights.to(x.dtype))
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    for expert in range(w13.shape[0]):
        y = F.linear(silu_and_mul(F.linear(x, w13[expert])), w2[expert])
        out += y * dense[:, expert : expert + 1]
    return out


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The torch path: fused_experts_ref, or dense_experts_ref while a CUDA graph is captured."""
    experts = dense_experts_ref if _capturing() else fused_experts_ref  # no host sync inside a graph
    return experts(x, w13, w2, topk_weights, topk_ids)


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, select: Select, *,
                 correction_bias: bool = False, fp32_logits: bool = False,
                 dense: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = F.linear,
                 dense_fp32: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 appended: int = 0) -> None:
        """dense: the product (LayerOps.linear: on CUDA the skinny GEMM for decode-sized steps,
        where cuBLAS ran a 64-row GEMM kernel for the [experts, hidden] matrix); dense_fp32:
        fp32 logits from x as it comes (LayerOps.linear_fp32: no cast launch), else dense on
        x.float(). appended: how many always-picked slots (ids num_experts..) `select` puts after
        the routed k (shared experts; ExpertLoad leaves them out of its counts)."""
        super().__init__()
        self.dense, self.dense_fp32, self.appended = dense, dense_fp32, appended
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        # DeepSeek V3 (noaux_tc): added to the scores for the choice of experts only
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts)) if correction_bias else None
        self.select = select
        self.fp32_logits = fp32_logits
        # ExpertLoad's counter row of this layer, handed to `select` as counts= when it adds its
        # picks itself (select_counts_picks: the Triton routing kernel); None: a hook counts
        self.count_into: Callable[[], torch.Tensor] | None = None
        self.count_rows: Callable[[], torch.Tensor] | None = None  # ExpertLoad.rows: the rows that count

    def select_counts_picks(self) -> bool:
        """Whether `select` takes counts= and adds each routed pick to it (in its launch)."""
        return bool(getattr(getattr(self.select, "func", self.select), "counts_picks", False))

    def first_product(self) -> FirstProduct:
        """The logits' product (fp32 logits from x as it comes: the weight is fp32 then)."""
        return FirstProduct(self.weight, None, torch.float32 if self.fp32_logits else None)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_logits and self.dense_fp32 is not None:
            return self.dense_fp32(x, self.weight.float())
        if self.fp32_logits:
            return self.dense(x.float(), self.weight.float(), None)
        return self.dense(x, self.weight, None)

    def select_kw(self) -> dict[str, torch.Tensor]:
        """What `select` takes besides the logits: ExpertLoad's counter row and rows, the bias."""
        kw = {} if self.count_into is None else {"counts": self.count_into()}
        if self.count_rows is not None:
            kw["count_rows"] = self.count_rows()
        if self.e_score_correction_bias is not None:
            kw["correction_bias"] = self.e_score_correction_bias
        return kw

    def forward(self, x: torch.Tensor, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: `self._logits(x)`, computed with the norm before (first_product)."""
        return self.select(self._logits(x) if logits is None else logits, **self.select_kw())


SHARED = "shared"  # the shard id's expert for the shared MLP's tensors (FusedExperts' slots E..)


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 parallel: ParallelContext = SINGLE, field: str = "moe_intermediate_size", shared: int = 0) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_experts, self.shared, self.intermediate = num_experts, shared, intermediate_size
        self.local_intermediate = parallel.split(intermediate_size, field)
        self.w13 = nn.Parameter(torch.empty(num_experts + shared, 2 * self.local_intermediate, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts + shared, hidden_size, self.local_intermediate))

    def param_shard_ids(self, param_name: str) -> tuple[ExpertShard, ...]:
        """The checkpoint tensors each parameter is made of (param_loader's completeness check)."""
        parts = ("w2",) if param_name == "w2" else ("w1", "w3")
        experts: list[int | str] = [*range(self.num_experts), *([SHARED] if self.shared else [])]
        return tuple((e, p) for e in experts for p in parts)  # type: ignore[misc]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ExpertShard) -> None:
        """One expert's full gate / up ([I, H]: this rank's rows) or down ([H, I]: its columns);
        expert SHARED: the shared MLP's ([S I, H] / [H, S I]), one I-wide cut per slot E.."""
        expert, part = shard_id
        if (part == "w2") != (param is self.w2) or part not in ("w1", "w2", "w3"):
            raise ValueError(f"shard {part!r} does not belong in this parameter")
        if expert == SHARED and self.shared:
            dim, n = (1 if part == "w2" else 0), self.intermediate
            if loaded.shape[dim] != self.shared * n:
                raise ValueError(f"has shape {tuple(loaded.shape)}: dim {dim} should be {self.shared} x {n}")
            for s in range(self.shared):
                self._load_slot(param, loaded.narrow(dim, s * n, n), self.num_experts + s, part)
            return
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts:  # a shared slot only by SHARED
            raise ValueError(f"names expert {expert}, the layer has {self.num_experts}")
        self._load_slot(param, loaded, expert, part)

    def _load_slot(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, part: str) -> None:
        if part == "w2":
            load_shard(param.data[expert], loaded, self.parallel, dim=1)
            return
        n = self.local_intermediate
        load_shard(param.data[expert].narrow(0, 0 if part == "w1" else n, n), loaded, self.parallel, dim=0)


class MoE(nn.Module):
    """gate + experts; forward(x [T, H]) -> [T, H]: the whole output on every rank."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, select: Select, *,
                 parallel: ParallelContext = SINGLE, field: str = "moe_intermediate_size",
                 correction_bias: bool = False, fp32_router_logits: bool = False,
                 ops: LayerOps = TORCH_OPS, shared: int = 0) -> None:
        """shared: experts every token runs at weight 1, in slots num_experts.. (`select` appends
        their picks: moe_routing.append_picks)."""
        super().__init__()
        self.gate = Router(hidden_size, num_experts, select, correction_bias=correction_bias,
                           fp32_logits=fp32_router_logits, dense=ops.linear, dense_fp32=ops.linear_fp32,
                           appended=shared)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, parallel=parallel, field=field,
                                    shared=shared)
        self.parallel = parallel
        self.reduce = parallel.world_size > 1  # fixed at build: TP=1 runs no collective
        # picked once: the layer kernels' fused MoE (Triton on CUDA: one grouped GEMM per
        # projection, no host sync, graph-safe) or the torch reference (the CPU path)
        self.run_experts = ops.fused_experts or torch_experts
        # the routing inside the experts' launches where the ops have it for this `select` (the
        # softmax top-k kernel's: LayerOps.softmax_topk_experts, at one token)
        self.route_experts = None
        if (ops.softmax_topk_experts is not None and isinstance(select, partial)
                and select.func is ops.softmax_topk and not select.args):
            self.route_experts = partial(ops.softmax_topk_experts, **select.keywords)
        # the picks left unsummed for the norm after the layer (LayerOps.pick_rows); a reduced
        # output is summed before its all-reduce
        self.experts_kw = {"sum_picks": False} if ops.pick_rows and not self.reduce else {}

    def first_product(self) -> FirstProduct:
        return self.gate.first_product()

    def forward(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """first: the router's logits of x, computed with the norm before (normed_input). With
        LayerOps.pick_rows the result may be a one-token step's weighted picks [1, k, H]."""
        if self.route_experts is not None:
            logits = self.gate._logits(x) if first is None else first
            y = self.route_experts(x, logits, self.experts.w13, self.experts.w2, **self.gate.select_kw(),
                                   **self.experts_kw)
        else:
            weights, ids = self.gate(x, first)
            y = self.run_experts(x, self.experts.w13, self.experts.w2, weights, ids, **self.experts_kw)
        return self.parallel.all_reduce(y) if self.reduce else y
