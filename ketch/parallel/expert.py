"""How the MoE layers use the ranks (`ParallelContext.ep`): expert parallelism, its dispatch,
DP attention and EPLB's settings. The EP ranks are the tensor-parallel ranks (SGLang's
ep_size == tp_size): the same group carries attention's collectives and the experts'.

    size == 1          no expert parallelism: every rank holds every expert's slice of the
                       intermediate features (ketch/layers/moe.py, TP MoE)
    size == world      expert parallel: each rank holds (experts + redundant) / size whole
                       experts (ketch/layers/moe_ep.py); attention stays tensor parallel
    dispatch           "all_reduce": every rank has every token (TP attention), computes its own
                       experts' share of each and one all-reduce sums them (the TP MoE's one
                       collective); "all_to_all": each (token, pick) goes to the rank owning its
                       expert and its output comes back (tokens that differ per rank)
    dp_attention       attention, dense MLPs, embedding and LM head run whole on every rank over
                       the rank's own requests (no TP); the MoE layers gather the ranks' tokens
                       (dispatch "all_reduce": an all-gather with per-rank counts, the all-reduce,
                       the rank's rows back) or exchange them ("all_to_all")
    num_redundant      EPLB's extra physical expert slots (replicas of hot experts)
    eplb_interval      > 0: re-place experts from the measured load every that many forwards
"""
from __future__ import annotations

from dataclasses import dataclass

DISPATCHES = ("all_reduce", "all_to_all")


@dataclass(frozen=True)
class ExpertParallel:
    size: int = 1
    dispatch: str = "all_reduce"
    dp_attention: bool = False
    num_redundant: int = 0
    eplb_interval: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"ep_size must be an int >= 1, got {self.size!r}")
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"ep dispatch must be {'|'.join(DISPATCHES)}, got {self.dispatch!r}")
        if self.num_redundant < 0:
            raise ValueError(f"ep_num_redundant_experts must be >= 0, got {self.num_redundant}")
        if self.eplb_interval < 0:
            raise ValueError(f"eplb_rebalance_num_iterations must be >= 0, got {self.eplb_interval}")
        if self.size == 1 and (self.dp_attention or self.num_redundant or self.eplb_interval):
            raise ValueError("ep_size: DP attention, redundant experts and EPLB need expert parallelism "
                             "(ep_size > 1)")

    @property
    def enabled(self) -> bool:
        return self.size > 1


NO_EP = ExpertParallel()
