"""A Hugging Face config.json as ketch reads it: its fields checked before any is used (a bad
value is a ValueError naming the field, not a TypeError or ZeroDivisionError deep in the build,
nor a value silently read as another: `tie_word_embeddings: "false"` is true to Python), and
what transformers derives from them that ketch needs (the sliding window). A leaf: no ketch import.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

# fields every family reads: positive integers where present (required ones are checked for
# presence where they are read); None stands for "absent" only where HF writes it so
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings")
_POSITIVE_INTS_OR_NONE = ("num_key_value_heads", "head_dim", "sliding_window", "moe_intermediate_size",
                          "num_experts", "num_local_experts", "num_experts_per_tok", "n_routed_experts")
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
_BOOLS = ("tie_word_embeddings", "attention_bias", "use_sliding_window", "norm_topk_prob")
_DICTS = ("rope_scaling", "rope_parameters")


def check_hf_fields(d: dict[str, Any]) -> None:
    """ValueError "<field>: ..." for the first field of `d` (a config.json) ketch cannot read."""
    for name in _POSITIVE_INTS + _POSITIVE_INTS_OR_NONE:
        if name in d and not (d[name] is None and name in _POSITIVE_INTS_OR_NONE) and not _positive_int(d[name]):
            raise ValueError(f"{name}: must be a positive integer in config.json, got {d[name]!r}")
    for name in _POSITIVE_NUMBERS:
        value = d.get(name)
        if name in d and not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf):
            raise ValueError(f"{name}: must be a positive number in config.json, got {value!r}")
    for name in _BOOLS:
        if name in d and not isinstance(d[name], bool):
            raise ValueError(f"{name}: must be true or false in config.json, got {d[name]!r}")
    for name in _DICTS:
        if d.get(name) is not None and not isinstance(d[name], dict):
            raise ValueError(f"{name}: must be an object in config.json, got {d[name]!r}")
    if d.get("head_dim") is not None and d["head_dim"] % 2:
        raise ValueError(f"head_dim: must be even (rotary embeddings rotate pairs), got {d['head_dim']}")


def sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    """The window of the layers that attend through one (transformers' rules), None if none does."""
    window = d.get("sliding_window")
    if not window:
        return None
    if d.get("layer_types") is not None:  # transformers 5 writes each layer's kind
        return window if "sliding_attention" in d["layer_types"] else None
    if model_type.startswith("qwen"):  # only with use_sliding_window, on layers max_window_layers..
        layers = d["num_hidden_layers"]
        return window if d.get("use_sliding_window") and d.get("max_window_layers", layers) < layers else None
    return window if model_type == "mistral" else None  # Mistral: every layer


def _positive_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0  # numpy's too
