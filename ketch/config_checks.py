"""EngineConfig's checks of the fields that lay an engine out over processes: expert parallelism
(and DP attention, EPLB) and PD disaggregation. A leaf below ketch/config.py (which calls them
from `EngineConfig.__post_init__`): it imports nothing of ketch."""
from __future__ import annotations

from typing import Any


def check_expert_parallel(c: Any) -> None:
    """ep_size is 1 or tensor_parallel_size (the EP ranks are the TP ranks, SGLang's
    ep_size == tp_size); redundant experts and EPLB need EP; DP attention is model-level only."""
    for name, least in (("ep_size", 1), ("ep_num_redundant_experts", 0), ("eplb_rebalance_num_iterations", 1)):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if c.ep_size not in (1, c.tensor_parallel_size):
        raise ValueError(f"ep_size: {c.ep_size} must be 1 or tensor_parallel_size ({c.tensor_parallel_size}): "
                         f"experts are split over the tensor-parallel ranks")
    for name in ("ep_num_redundant_experts", "enable_eplb"):
        if getattr(c, name) and c.ep_size == 1:
            raise ValueError(f"{name} (--{name.replace('_', '-')}) needs expert parallelism: add --ep-size "
                             f"{max(c.tensor_parallel_size, 2)}")
    if c.enable_dp_attention:
        raise ValueError("enable_dp_attention: the engine does not run DP attention yet (it needs one scheduler "
                         "per DP rank); the model-level forward is ExpertParallel(dp_attention=True)")


def check_disaggregation(c: Any, modes: tuple[str, ...]) -> None:
    if c.disaggregation_mode not in modes:
        raise ValueError(f"disaggregation_mode must be {'|'.join(modes)}, got {c.disaggregation_mode!r}")
    if c.disaggregation_transfer_backend not in ("fake", "tcp", "nixl", "mooncake"):
        raise ValueError(f"disaggregation_transfer_backend must be fake|tcp|nixl|mooncake, got {c.disaggregation_transfer_backend!r}")
    if not isinstance(c.disaggregation_bootstrap_port, int) or not 0 <= c.disaggregation_bootstrap_port <= 65535:
        raise ValueError(f"disaggregation_bootstrap_port must be an int in [0, 65535], got {c.disaggregation_bootstrap_port!r}")
    if not 0 < c.disaggregation_timeout < float("inf"):
        raise ValueError(f"disaggregation_timeout must be a number of seconds > 0, got {c.disaggregation_timeout!r}")
    if c.disaggregation_mode != "null" and c.tensor_parallel_size > 1:
        raise ValueError("disaggregation_mode: not supported with tensor_parallel_size > 1 yet")
