"""One loading loop for every family: HF-named checkpoint tensor -> (parameter, shard id) ->
the owning layer's loader, which copies its rank's slice into place.

`packed` maps a checkpoint projection to the fused parameter that holds it and its slot there,
e.g. {"q_proj": ("qkv_proj", "q"), "gate_proj": ("gate_up_proj", 0)}. A layer with
`weight_loader(param, full, shard_id)` slices for itself (ketch/layers/parallel_linear.py,
vocab_parallel.py); any other parameter is replicated and copied whole. Every (parameter,
shard id) must arrive exactly as the layers' `shard_ids` say, or loading fails naming it.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ketch.layers.linear import Linear, concat_q4
from ketch.layers.q4 import Q4Weight
from ketch.layers.sharding import replicated_loader

Packed = Mapping[str, tuple[str, Any]]
NameMap = Callable[[str], "tuple[str, Any] | None"]  # checkpoint name -> (parameter, shard id), or None


def expert_name_map(projections: Mapping[str, str], block: str = "mlp", module: str = "mlp") -> NameMap:
    """`<layer>.<block>.experts.<e>.<proj>.weight` -> (`<layer>.<module>.experts.w13` or `.w2`,
    (e, projections[proj])); `projections` maps the checkpoint's names to "w1" (gate), "w3" (up)
    and "w2" (down), e.g. Qwen-MoE's {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}."""
    pattern = re.compile(rf"(.+)\.{re.escape(block)}\.experts\.(\d+)\.(\w+)\.weight")

    def name_map(name: str) -> tuple[str, Any] | None:
        m = pattern.fullmatch(name)
        if m is None or m.group(3) not in projections:
            return None
        part = projections[m.group(3)]
        return f"{m.group(1)}.{module}.experts.{'w2' if part == 'w2' else 'w13'}", (int(m.group(2)), part)

    return name_map


def fused_name(name: str, packed: Packed) -> tuple[str, Any]:
    """Checkpoint name (without the "model." prefix) -> (our parameter name, shard id)."""
    for part, (fused, shard_id) in packed.items():
        if f".{part}." in name:
            return name.replace(part, fused), shard_id
    return name, None


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def _shard_ids(model: nn.Module, param_name: str) -> tuple[Any, ...]:
    owner = _owner(model, param_name)
    per_param = getattr(owner, "param_shard_ids", None)
    if per_param is not None:
        return per_param(param_name.rpartition(".")[2])
    return getattr(owner, "shard_ids", (None,))


def _target(name: str, packed: Packed, name_maps: Sequence[NameMap]) -> tuple[str, Any]:
    name = name.removeprefix("model.")
    for name_map in name_maps:
        found = name_map(name)
        if found is not None:
            return found
    return fused_name(name, packed)


def load_parameters(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], packed: Packed,
                    optional: frozenset[str] = frozenset(), name_maps: Sequence[NameMap] = ()) -> None:
    """`optional`: names a checkpoint may carry that this model may lack (a tied lm_head copy);
    `name_maps`: tried in order before `packed` (expert_name_map)."""
    params = dict(model.named_parameters())
    loaded: set[tuple[str, Any]] = set()
    for name, tensor in weights:
        target, shard_id = _target(name, packed, name_maps)
        if target not in params:
            if target in optional:
                continue
            raise ValueError(f"model: unexpected weight {name!r}")
        owner = _owner(model, target)
        loader = getattr(owner, "weight_loader", replicated_loader)
        try:
            loader(params[target], tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"model: weight {name!r} {e}") from None
        loaded.add((target, shard_id))
    expected = {(n, s) for n in params for s in _shard_ids(model, n)}
    missing = expected - loaded
    if missing:
        raise ValueError(f"model: missing weights {sorted(map(str, missing))[:5]}...")


def load_int4_parts(model: nn.Module, weights: Iterable[tuple[str, Q4Weight]], packed: Packed) -> int:
    """Attach 4-bit copies to the linear layers whose every part came as 4-bit blocks and could be
    sliced for this rank (`int4_part`); the rest stay dense. Returns how many layers got one."""
    modules = dict(model.named_modules())
    parts: dict[str, dict[Any, Q4Weight | None]] = {}
    for name, w in weights:
        target, shard_id = fused_name(name.removeprefix("model."), packed)
        module_name = target.removesuffix(".weight")
        module = modules.get(module_name)
        if target.endswith(".weight") and isinstance(module, Linear) and hasattr(module, "int4_part"):
            parts.setdefault(module_name, {})[shard_id] = module.int4_part(w, shard_id)
    attached = 0
    for module_name, by_id in parts.items():
        module = modules[module_name]
        pieces = [by_id.get(s) for s in module.shard_ids]
        if any(p is None for p in pieces):
            continue  # some part of this fused layer was not 4-bit (or not sliceable): keep it dense
        module.attach_int4(concat_q4(pieces))
        attached += 1
    return attached
