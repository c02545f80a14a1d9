"""The fp8 e4m3 KV option (EngineConfig.kv_cache_dtype="fp8_e4m3") on the tiny random model (CPU):
the pool holds 2x (bf16 model) / 4x (fp32 model) the pages; greedy output stays close to fp32 KV;
the Triton and torch paths agree under fp8, and the static-buffer decode equals the eager step.
Also the option's validation and its CLI flag."""
from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest

pytest.importorskip("triton")

from conftest import greedy_ids_and_logprobs, make_tiny_engine

from ketch.cli_args import add_engine_args, engine_kwargs
from ketch.config import EngineConfig, KVSpec
from ketch.engine.engine import Engine
from ketch.runner.graph_runner import GraphRunner

FP8 = torch.float8_e4m3fn

# ---------------------------------------------------------------- engine, tiny model (CPU)

PROMPTS = [[5, 9, 11], list(range(3, 40)), [7] * 9, list(range(3, 30))]  # the last shares 6 pages with the second


def _fp8_engine(tiny_config_path: str, **kw) -> Engine:
    return make_tiny_engine(tiny_config_path, device="cpu", kv_cache_dtype="fp8_e4m3", **kw)


def test_fp8_pool_holds_twice_the_pages_of_bf16(tiny_config_path):
    budget = 3 << 20
    pages = {}
    for dtype in ("bfloat16", "float32"):
        for kv in ("auto", "fp8_e4m3"):
            cfg = EngineConfig(model=tiny_config_path, load_format="dummy", dtype=dtype, device="cpu",
                               kv_cache_memory=budget, page_size=4, kv_cache_dtype=kv)
            assert cfg.kv_torch_dtype == (FP8 if kv == "fp8_e4m3" else cfg.torch_dtype)
            pool = Engine(cfg).runner.pool
            assert pool.k[0].dtype == pool.v[0].dtype == cfg.kv_torch_dtype and pool.compute_dtype == cfg.torch_dtype
            pages[dtype, kv] = pool.num_pages
    assert pages["bfloat16", "fp8_e4m3"] == pages["float32", "fp8_e4m3"] == 2 * pages["bfloat16", "auto"]
    assert pages["float32", "fp8_e4m3"] == 4 * pages["float32", "auto"]
    per_page = KVSpec.mha(2, 2, 16).bytes_per_page(4, FP8)  # the tiny model: 2 layers, 2 kv heads of 16
    assert pages["float32", "fp8_e4m3"] == budget // per_page


@pytest.fixture(scope="module")
def fp8_torch_reference(tiny_config_path):
    engine = _fp8_engine(tiny_config_path)
    assert engine.runner.attention_backend == "torch"
    out = greedy_ids_and_logprobs(engine, PROMPTS, max_tokens=8)
    assert engine.scheduler.stats.cached_prompt_tokens > 0  # the last prompt read an fp8 prefix
    engine.check_invariants()
    return out


def _close(a: list[list[float]], b: list[list[float]], tol: float) -> None:
    for x, y in zip(a, b, strict=True):
        assert max(abs(u - v) for u, v in zip(x, y, strict=True)) < tol


def test_fp8_engine_differs_from_fp32_kv_but_stays_close(tiny_config_path, fp8_torch_reference):
    """The random tiny model's chosen-token logprobs moved by at most 0.005 (measured); 0.02 allowed."""
    ids, lps = greedy_ids_and_logprobs(make_tiny_engine(tiny_config_path, device="cpu"), PROMPTS, max_tokens=8)
    assert fp8_torch_reference[1] != lps  # the pool really is fp8
    assert [i[0] for i in fp8_torch_reference[0]] == [i[0] for i in ids]
    _close(fp8_torch_reference[1], lps, 0.02)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path; the GPU test covers CUDA")
def test_triton_path_matches_torch_path_under_fp8(tiny_config_path, fp8_torch_reference):
    engine = _fp8_engine(tiny_config_path, attention_backend="triton", layer_kernels="triton")
    ids, lps = greedy_ids_and_logprobs(engine, PROMPTS, max_tokens=8)
    assert ids == fp8_torch_reference[0]
    _close(lps, fp8_torch_reference[1], 1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path; the GPU test covers CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_buffer_decode_equals_the_eager_step_under_fp8(tiny_config_path, fp8_torch_reference, backend):
    """What a CUDA graph records (run eagerly off CUDA): the torch one builds its mask in the
    model's dtype, not the pool's; both store and read fp8 like the eager step."""
    engine = _fp8_engine(tiny_config_path, attention_backend=backend, layer_kernels=backend)
    r = engine.runner
    r.graphs = GraphRunner(r.model, r.attn, max_bs=8, max_model_len=engine.max_model_len, device=r.device,
                           future=r.future)
    calls = []
    run = r.graphs.run
    r.graphs.run = lambda chunks: calls.append(len(chunks)) or run(chunks)
    ids, lps = greedy_ids_and_logprobs(engine, PROMPTS, max_tokens=8)
    assert 4 in calls
    assert ids == fp8_torch_reference[0]
    _close(lps, fp8_torch_reference[1], 1e-4)
    engine.check_invariants()


# ---------------------------------------------------------------- config and CLI


def test_bad_kv_cache_dtype_is_a_value_error_naming_the_field():
    for bad in ("fp8", "float8_e4m3fn", "bfloat16", ""):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig(device="cpu", kv_cache_dtype=bad)
    default = EngineConfig(device="cpu")
    assert default.kv_cache_dtype == "auto" and default.kv_torch_dtype == default.torch_dtype
    assert EngineConfig(device="cpu", dtype="float32", kv_cache_dtype="fp8_e4m3").kv_torch_dtype == FP8


def test_cli_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["kv_cache_dtype"] == "auto"
    kw = engine_kwargs(parser.parse_args(["--kv-cache-dtype", "fp8_e4m3", "--device", "cpu"]))
    assert EngineConfig(**kw).kv_torch_dtype == FP8
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp16"])
