"""config.json fields checked before use (ketch/hf_config.py): a bad value is a ValueError naming
the field, never a TypeError / ZeroDivisionError deep in the build, nor a value read as another
(`"false"` is true to Python; `num_key_value_heads: 0` became plain multi-head attention)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ketch.models import load_model_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LLAMA = json.loads((CONFIGS / "smollm2-135m" / "config.json").read_text())
DEEPSEEK = json.loads((CONFIGS / "deepseek-v2-lite" / "config.json").read_text())


@pytest.mark.parametrize("base, field, value", [
    (LLAMA, "max_position_embeddings", None), (LLAMA, "num_attention_heads", 0), (LLAMA, "hidden_size", "576"),
    (LLAMA, "num_key_value_heads", 0), (LLAMA, "vocab_size", 49152.0), (LLAMA, "num_hidden_layers", True),
    (LLAMA, "rms_norm_eps", "1e-5"), (LLAMA, "rms_norm_eps", float("nan")), (LLAMA, "rope_theta", -1),
    (LLAMA, "tie_word_embeddings", "false"), (LLAMA, "rope_scaling", "linear"), (LLAMA, "head_dim", 63),
    (DEEPSEEK, "kv_lora_rank", 0), (DEEPSEEK, "num_attention_heads", -16), (DEEPSEEK, "qk_rope_head_dim", "64"),
], ids=lambda v: repr(v) if not isinstance(v, dict) else v["architectures"][0])
def test_a_bad_field_is_a_value_error_naming_it(tmp_path, base, field, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, field: value}))
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        load_model_config(str(path), "dummy")


def test_every_bundled_config_still_loads():
    for d in sorted(p for p in CONFIGS.iterdir() if p.is_dir()):
        assert load_model_config(str(d), "dummy").vocab_size > 0, d.name
