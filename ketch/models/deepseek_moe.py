"""DeepSeek-V2/V3's mixture-of-experts layers (every layer >= first_k_dense_replace, every
moe_layer_freq-th): ketch/layers/moe.py's routed experts plus a dense "shared experts" MLP
(n_shared_experts x moe_intermediate_size) that every token runs, added to the routed output.

Routing (ketch/layers/moe_routing.py `grouped_topk`), as transformers 5 runs it:

    V2   softmax scores; topk_method "greedy" (all experts one group) or "group_limited_greedy"
         (n_group groups scored by their best expert, the best topk_group kept); the k weights
         are the scores times routed_scaling_factor, never renormalised (HF's V2 router has no
         norm_topk_prob; released V2 configs say false anyway)
    V3   sigmoid scores, noaux_tc whatever scoring_func / topk_method say (HF reads neither; a
         config naming another method is refused here rather than silently routed as noaux_tc):
         e_score_correction_bias is added for the choice of groups (their two best biased scores)
         and experts only, the weights are the unbiased scores, renormalised when norm_topk_prob,
         then times routed_scaling_factor

The router's logits are fp32 (hidden states and gate weight in fp32, as HF) and its two tensors,
gate.weight and gate.e_score_correction_bias, stay fp32 in a bf16 model (`FP32_WEIGHTS`: HF's
`_keep_in_fp32_modules_strict`; the runner neither casts nor loads them in the model dtype): the
bias decides which experts run and bf16 would round it by ~0.4%.

Checkpoint names per MoE layer `model.layers.<i>.mlp.`: gate.weight [E, H],
gate.e_score_correction_bias [E] (V3), experts.<e>.{gate,up,down}_proj.weight (one expert at a
time: HF 5's fused gate_up_proj / down_proj are saved per expert), shared_experts.{gate,up,down}_proj.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ketch.layers.moe import SHARED, MoE
from ketch.layers.moe_ep import ExpertParallelMoE
from ketch.layers.moe_routing import append_picks, grouped_topk
from ketch.layers.ops import LayerOps
from ketch.models.llama import LlamaMLP
from ketch.models.param_loader import expert_name_map
from ketch.parallel import SINGLE, ParallelContext

if TYPE_CHECKING:
    from ketch.models.deepseek_family import DeepseekConfig

V3 = "DeepseekV3ForCausalLM"
FP32_WEIGHTS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # name suffixes kept fp32
V2_METHODS = ("greedy", "group_limited_greedy")
PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # a checkpoint projection's FusedExperts part
EXPERT_NAMES = expert_name_map(PARTS)


def shared_expert_names(name: str) -> tuple[str, Any] | None:
    """`<layer>.mlp.shared_experts.<proj>.weight` -> (`<layer>.mlp.experts.w13` or `.w2`,
    (SHARED, part)) where the shared MLP is folded into the fused experts."""
    head, sep, tail = name.partition(".mlp.shared_experts.")
    proj = tail.removesuffix(".weight")
    if not sep or proj not in PARTS or not tail.endswith(".weight"):
        return None
    part = PARTS[proj]
    return f"{head}.mlp.experts.{'w2' if part == 'w2' else 'w13'}", (SHARED, part)


def moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """DeepseekConfig's routing fields from config.json (defaults: HF's), checked; none (the
    dataclass defaults) when no layer is a mixture of experts."""
    v3 = d["architectures"][0] == V3
    first, freq = d.get("first_k_dense_replace") or 0, d.get("moe_layer_freq") or 1
    if not d.get("n_routed_experts") or not any(i % freq == 0 for i in range(first, d["num_hidden_layers"])):
        return {}
    groups = (8, 4) if v3 else (1, 1)  # HF's defaults where config.json has no n_group / topk_group
    f = dict(moe_intermediate_size=int(d["moe_intermediate_size"]),
             n_shared_experts=int(d.get("n_shared_experts", 1 if v3 else 2) or 0),
             num_experts_per_tok=int(d["num_experts_per_tok"]), n_group=int(d.get("n_group") or groups[0]),
             topk_group=int(d.get("topk_group") or groups[1]),
             routed_scaling_factor=float(d.get("routed_scaling_factor", 2.5 if v3 else 1.0)))
    method, scoring = d.get("topk_method"), d.get("scoring_func")
    if v3:
        if method not in (None, "noaux_tc") or scoring not in (None, "sigmoid"):
            raise ValueError(f"topk_method / scoring_func: DeepSeek-V3 routes noaux_tc over sigmoid scores, "
                             f"got {method!r} / {scoring!r}")
        f |= dict(topk_method="noaux_tc", norm_topk_prob=bool(d.get("norm_topk_prob", True)))
    else:
        if (method or "greedy") not in V2_METHODS or scoring not in (None, "softmax"):
            raise ValueError(f"topk_method / scoring_func: DeepSeek-V2 routes {' or '.join(V2_METHODS)} over "
                             f"softmax scores, got {method!r} / {scoring!r}")
        f |= dict(topk_method=method or "greedy", norm_topk_prob=False)
        if f["topk_method"] == "greedy":
            f |= dict(n_group=1, topk_group=1)
    experts, k = int(d["n_routed_experts"]), f["num_experts_per_tok"]
    if not 0 < k <= experts:
        raise ValueError(f"num_experts_per_tok: {k} of {experts} experts")
    if experts % f["n_group"] or not 0 < f["topk_group"] <= f["n_group"]:
        raise ValueError(f"n_group / topk_group: {experts} experts in {f['n_group']} groups, {f['topk_group']} kept")
    if k > f["topk_group"] * experts // f["n_group"]:
        raise ValueError(f"num_experts_per_tok: {k} exceeds the experts of {f['topk_group']} groups")
    return f


def moe_shapes(c: DeepseekConfig, p: str) -> dict[str, tuple[int, ...]]:
    """One MoE layer's checkpoint tensors under prefix `p` ("model.layers.<i>.mlp.")."""
    e, h, inter = c.n_routed_experts or 0, c.hidden_size, c.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (e, h)}
    if c.topk_method == "noaux_tc":
        shapes[p + "gate.e_score_correction_bias"] = (e,)
    for i in range(e):
        q = f"{p}experts.{i}."
        shapes |= {q + "gate_proj.weight": (inter, h), q + "up_proj.weight": (inter, h), q + "down_proj.weight": (h, inter)}
    if c.n_shared_experts:
        s, q = inter * c.n_shared_experts, p + "shared_experts."
        shapes |= {q + "gate_proj.weight": (s, h), q + "up_proj.weight": (s, h), q + "down_proj.weight": (h, s)}
    return shapes


def routing(c: DeepseekConfig, ops: LayerOps | None = None,
            appended: int = 0) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """grouped_topk with this config's numbers (logits[, correction_bias=]) -> (weights, ids),
    with `appended` always-picked slots after the k (the shared experts folded into the fused
    MoE: append_picks).

    V2 routing that masks no group (greedy, or every group kept) is softmax top-k times the
    scaling factor: with layer ops that have a softmax top-k kernel (Triton: one launch, where
    torch's softmax + topk ran four kernels a layer) it runs that instead, scaling and appending
    in the same launch. (Its +1e-20 in the renormalisation cannot move a sum of softmax
    probabilities, which is at least 1 / experts.)"""
    if (ops is not None and ops.softmax_topk is not None and c.topk_method != "noaux_tc"
            and (c.n_group <= 1 or c.topk_group >= c.n_group)):
        return partial(ops.softmax_topk, top_k=c.num_experts_per_tok, renormalize=c.norm_topk_prob,
                       scale=c.routed_scaling_factor, append=appended)
    grouped = partial(grouped_topk, top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
                      scoring="sigmoid" if c.topk_method == "noaux_tc" else "softmax",
                      renormalize=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor)
    return partial(_appended, grouped, first=c.n_routed_experts or 0, count=appended) if appended else grouped


def _appended(select: Callable[..., tuple[torch.Tensor, torch.Tensor]], logits: torch.Tensor, *, first: int,
              count: int, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return append_picks(*select(logits, **kw), first, count)


def folds_shared_experts(c: DeepseekConfig, ops: LayerOps) -> bool:
    """With a fused MoE kernel (the Triton ops) the shared MLP of n_shared_experts x
    moe_intermediate_size features runs as n_shared_experts more experts that every token picks
    at weight 1: the same products and bytes in the MoE's launches, where the MLP took its own
    four (gate|up, SiLU, down, add) at every step. The torch path (the CPU, HF's reference
    arithmetic) keeps the separate MLP."""
    return ops.fused_experts is not None and c.n_shared_experts > 0


class DeepseekMoE(MoE):
    """gate + routed experts (MoE) + shared experts; forward(x [T, H]) -> [T, H]."""

    def __init__(self, c: DeepseekConfig, ops: LayerOps, parallel: ParallelContext = SINGLE) -> None:
        """Tensor parallel: routed and shared experts split by intermediate feature, the router
        whole on every rank; the two partial sums are added first and summed over the ranks once
        (one all-reduce a layer, not one each)."""
        folded = c.n_shared_experts if folds_shared_experts(c, ops) else 0
        super().__init__(c.hidden_size, c.n_routed_experts or 0, c.moe_intermediate_size, routing(c, ops, folded),
                         parallel=parallel, correction_bias=c.topk_method == "noaux_tc", fp32_router_logits=True,
                         ops=ops, shared=folded)
        shared = 0 if folded else c.moe_intermediate_size * c.n_shared_experts
        self.shared_experts = LlamaMLP(c, ops, parallel, intermediate_size=shared) if shared else None  # type: ignore[arg-type]
        if self.shared_experts is not None:
            self.shared_experts.down_proj.reduce = False  # this rank's partial sum: reduced with the routed one

    def forward(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        if self.shared_experts is None:
            return super().forward(x, first)
        weights, ids = self.gate(x, first)
        y = self.run_experts(x, self.experts.w13, self.experts.w2, weights, ids) + self.shared_experts(x)
        return self.parallel.all_reduce(y) if self.reduce else y


class DeepseekEPMoE(ExpertParallelMoE):
    """`--ep-size`: whole routed experts split over the ranks (ketch/layers/moe_ep.py: dispatch,
    EPLB's slots), the shared experts split as the dense MLPs are (by intermediate feature under
    tensor-parallel attention); forward(x [T, H]) -> [T, H]."""

    def __init__(self, c: DeepseekConfig, ops: LayerOps, parallel: ParallelContext) -> None:
        super().__init__(c.hidden_size, c.n_routed_experts or 0, c.moe_intermediate_size, routing(c), parallel=parallel,
                         correction_bias=c.topk_method == "noaux_tc", fp32_router_logits=True)
        shared = c.moe_intermediate_size * c.n_shared_experts
        self.shared_experts = LlamaMLP(c, ops, parallel.for_attention(),  # type: ignore[arg-type]
                                       intermediate_size=shared) if shared else None

    def forward(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """first: never given (no first_product: the experts' dispatch reads x)."""
        y = super().forward(x)
        return y if self.shared_experts is None else y + self.shared_experts(x)
