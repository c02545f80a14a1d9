"""EngineConfig refuses what it cannot run with a ValueError naming the field, at construction
(not a torch RuntimeError, TypeError or AssertionError from deep inside the build), and the build
refuses a CUDA device where torch has none."""
from __future__ import annotations

import pytest
import torch

from ketch.config import EngineConfig


@pytest.mark.parametrize("kwargs, field", [
    ({"device": "foo"}, "device"),
    ({"device": "meta"}, "device"),
    ({"device": 3}, "device"),
    ({"max_model_len": -5}, "max_model_len"),
    ({"max_model_len": 0}, "max_model_len"),  # was the model's default, silently
    ({"max_model_len": 3.5}, "max_model_len"),
    ({"page_size": 2.5}, "page_size"),
    ({"page_size": 0}, "page_size"),
    ({"max_num_seqs": 1.5}, "max_num_seqs"),
    ({"max_num_seqs": "8"}, "max_num_seqs"),
    ({"max_num_batched_tokens": None}, "max_num_batched_tokens"),
    ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
    ({"num_threads": -1}, "num_threads"),
    ({"num_threads": True}, "num_threads"),
    ({"kv_cache_memory": float("nan")}, "kv_cache_memory"),
    ({"kv_cache_memory": -1}, "kv_cache_memory"),
    ({"kv_cache_memory": "1GB"}, "kv_cache_memory"),
    # a PD setting without the mode that uses it: it was ignored, and showed later as 400s
    ({"disaggregation_transfer_backend": "nixl"}, "disaggregation_transfer_backend .* needs PD disaggregation"),
    ({"disaggregation_bootstrap_port": 9000}, "disaggregation_bootstrap_port .* needs PD disaggregation"),
    ({"disaggregation_bootstrap_host": "10.0.0.1"}, "disaggregation_bootstrap_host .* needs PD disaggregation"),
    ({"disaggregation_timeout": 5.0}, "disaggregation_timeout .* needs PD disaggregation"),
    ({"disaggregation_mode": "decode", "disaggregation_bootstrap_port": 9000},
     "disaggregation_bootstrap_port .* a decode server has no bootstrap socket"),
])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(**kwargs)


def test_good_settings_pass():
    for device in ("auto", "cpu", "cuda", "cuda:1"):  # a name check: CUDA's presence is the build's
        EngineConfig(device=device, cuda_graph=False)
    EngineConfig(max_model_len=128, num_threads=1, kv_cache_memory=1 << 20, chunked_prefill_size=64)
    EngineConfig(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl", disaggregation_bootstrap_port=0,
                 disaggregation_bootstrap_host="10.0.0.1", disaggregation_timeout=5.0)
    EngineConfig(disaggregation_mode="decode", disaggregation_transfer_backend="nixl", disaggregation_timeout=5.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_cuda_is_refused_at_the_build(tiny_config_path):
    from conftest import make_tiny_engine

    with pytest.raises(ValueError, match="^device: 'cuda' was asked for"):
        make_tiny_engine(tiny_config_path, device="cuda", cuda_graph=False)


def test_a_context_past_the_models_positions_is_refused_at_the_build(tiny_config_path):
    """The tiny model knows 1024 positions (conftest's TINY_LLAMA): up to there is fine."""
    from conftest import make_tiny_engine

    assert make_tiny_engine(tiny_config_path, max_model_len=1024).max_model_len == 1024
    with pytest.raises(ValueError, match="^max_model_len: 1025 is past the model's max_position_embeddings"):
        make_tiny_engine(tiny_config_path, max_model_len=1025)


@pytest.mark.parametrize("field", ["layer_kernels", "attention_backend"])
def test_triton_kernels_without_a_gpu_are_refused_at_construction(field, monkeypatch):
    """On a CPU (no interpreter) Triton finds no driver only when a kernel launches: `ketch serve
    --layer-kernels triton` said it was serving, and its first request killed the engine."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=f"^{field}: 'triton' needs a CUDA device"):
        EngineConfig(device="cpu", **{field: "triton"})
    EngineConfig(device="cuda", cuda_graph=False, **{field: "triton"})  # a name check: CUDA's presence is the build's
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    EngineConfig(device="cpu", **{field: "triton"})  # the interpreter runs them (the kernel tests)
