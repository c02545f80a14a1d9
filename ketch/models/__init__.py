"""Model families: each declares its config, KV spec, checkpoint tensors and model (family.py)."""
from ketch.models.family import AttentionFactory, CausalLM, FamilyConfig, ModelFamily, mha_attention_backend
from ketch.models.registry import (
    FAMILIES,
    config_from_hf,
    expected_weight_names,
    family_for,
    load_model_config,
    register_family,
    weight_shapes,
)

__all__ = ["FAMILIES", "AttentionFactory", "CausalLM", "FamilyConfig", "ModelFamily", "config_from_hf",
           "expected_weight_names", "family_for", "load_model_config", "mha_attention_backend", "register_family",
           "weight_shapes"]
