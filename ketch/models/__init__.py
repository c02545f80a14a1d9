"""Model families: each declares its config, KV spec, checkpoint tensors and model (family.py)."""
from ketch.models.family import CausalLM, FamilyConfig, ModelFamily
from ketch.models.registry import (
    FAMILIES,
    config_from_hf,
    expected_weight_names,
    family_for,
    load_model_config,
    weight_shapes,
)

__all__ = ["FAMILIES", "CausalLM", "FamilyConfig", "ModelFamily", "config_from_hf", "expected_weight_names",
           "family_for", "load_model_config", "weight_shapes"]
