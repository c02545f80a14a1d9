"""The GPU memory plan (ketch/runner/memory_plan.py): the arithmetic on the CPU with made-up
device numbers, the config and CLI fields, and on CUDA an engine whose pool is sized by a
measured plan running a step of the largest size (skipped without CUDA)."""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import pytest
import torch

from conftest import collect, drain
from ketch.cli_args import add_engine_args, engine_kwargs
from ketch.config import EngineConfig
from ketch.runner.memory_plan import SAFETY_MARGIN, plan_kv_pool, profile_step_lens

GB = 1 << 30
PAGE = 2 << 20  # 2 MiB: one 16-token page of Llama-3.1-8B in bf16


def plan(**kw):
    args = dict(total=140 * GB, used_after_load=16 * GB, free=123 * GB, peak=3 * GB, mem_fraction_static=0.9,
                page_bytes=PAGE, margin=GB)
    return plan_kv_pool(**(args | kw))


def test_fraction_cap_binds_when_the_measurement_leaves_more():
    p = plan()  # cap 0.9 * 140 - 16 = 110 GiB; measured 123 - 3 - 1 = 119 GiB
    assert p.bound == "mem_fraction_static"
    assert p.num_pages == (int(140 * GB * 0.9) - 16 * GB) // PAGE
    assert p.pool_bytes <= int(140 * GB * 0.9) - 16 * GB < p.pool_bytes + PAGE


def test_measured_peak_binds_when_it_leaves_less():
    p = plan(mem_fraction_static=1.0, peak=10 * GB)  # cap 124 GiB; measured 123 - 10 - 1 = 112 GiB
    assert p.bound == "measured"
    assert p.num_pages == (123 * GB - 10 * GB - GB) // PAGE
    assert plan(mem_fraction_static=1.0, peak=11 * GB).num_pages == p.num_pages - GB // PAGE


def test_default_margin_is_taken_off_the_measured_bound():
    p = plan_kv_pool(total=140 * GB, used_after_load=16 * GB, free=100 * GB, peak=2 * GB, mem_fraction_static=0.9,
                     page_bytes=PAGE)
    assert (p.bound, p.margin, p.num_pages) == ("measured", SAFETY_MARGIN, (98 * GB - SAFETY_MARGIN) // PAGE)


def test_explicit_kv_cache_memory_wins_over_both_bounds():
    p = plan(kv_cache_memory=200 * GB, free=GB)  # more than the device: the caller's choice
    assert (p.bound, p.num_pages) == ("kv_cache_memory", 200 * GB // PAGE)


def test_h200_8b_default_is_at_least_the_old_pool():
    """The old rule gave 0.85 of the memory free after the weights; 0.9 of the total gives more
    on a 139.8 GiB H200 with an 8B bf16 model (15 GiB weights + ~0.5 GiB context)."""
    total, used = int(139.8 * GB), int(15.5 * GB)
    old = 0.85 * (total - used)
    p = plan(total=total, used_after_load=used, free=total - used, peak=4 * GB)
    assert p.pool_bytes >= old


@pytest.mark.parametrize("kw", [dict(used_after_load=127 * GB),  # the fraction leaves nothing
                                dict(free=4 * GB + PAGE // 2)])  # the measurement leaves under a page
def test_no_room_is_a_value_error_naming_mem_fraction_static(kw):
    with pytest.raises(ValueError, match="mem_fraction_static"):
        plan(**kw)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, 2.0])
def test_bad_fraction_is_a_value_error(value):
    with pytest.raises(ValueError, match="mem_fraction_static"):
        plan(mem_fraction_static=value)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        EngineConfig(device="cpu", mem_fraction_static=value)


def test_config_and_cli_field():
    assert EngineConfig(device="cpu").mem_fraction_static == 0.9
    assert EngineConfig(device="cpu", mem_fraction_static=1.0).mem_fraction_static == 1.0
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kw = engine_kwargs(parser.parse_args(["--mem-fraction-static", "0.8"]))
    assert EngineConfig(**kw).mem_fraction_static == 0.8
    assert engine_kwargs(parser.parse_args([]))["mem_fraction_static"] == 0.9
    with pytest.raises(SystemExit):  # the old flag is gone (its fraction was of the free memory)
        parser.parse_args(["--gpu-kv-cache-fraction", "0.8"])


@pytest.mark.parametrize("tokens, seqs, chunk", [(2048, 256, 2048), (2048, 256, 512), (2048, 4, 256),
                                                 (8, 256, 8), (1, 1, 1), (300, 300, 100), (4096, 3, 4096)])
def test_profile_step_is_the_largest_step_the_scheduler_can_build(tokens, seqs, chunk):
    lens = profile_step_lens(tokens, seqs, chunk)
    rows = min(seqs, tokens)
    assert len(lens) == rows  # every allowed sampling row
    assert sum(lens) == min(tokens, rows * chunk)  # the token budget, unless the rows cannot hold it
    assert all(1 <= n <= chunk for n in lens)
    assert lens == sorted(lens)  # decode-like (1-token) chunks first


def test_profile_step_runs_on_a_one_page_scratch_pool(tiny_config_path):
    """Every chunk's pages are page 0 of the scratch pool; the step still runs at full shape."""
    from conftest import make_tiny_engine
    from ketch.attention.registry import create_attention_backend
    from ketch.cache.kv_pool import KVPool
    from ketch.config import KVSpec
    from ketch.runner.memory_plan import run_largest_step

    runner = make_tiny_engine(tiny_config_path, device="cpu").runner
    cfg, ps = runner.model_config, runner.config.page_size
    pool = KVPool(KVSpec.mha(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), 1, ps, torch.float32, runner.device)
    attn = create_attention_backend("torch", pool, cfg.num_heads, cfg.head_dim, runner.device)
    lens = profile_step_lens(96, 8, 64)
    logits = run_largest_step(runner.model, attn, lens, ps, runner.device)
    assert logits.shape == (len(lens), cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------------ CUDA
LLAMA_8B = Path(__file__).resolve().parents[1] / "configs" / "llama-3.1-8b" / "config.json"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def sliced_8b(tmp_path: Path) -> str:
    d = json.loads(LLAMA_8B.read_text())
    d["num_hidden_layers"] = 4  # every dimension real, fewer layers
    path = tmp_path / "llama-3.1-8b-4l.json"
    path.write_text(json.dumps(d))
    return str(path)


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@cuda
@pytest.mark.parametrize("fraction, bound", [(0.5, "mem_fraction_static"), (1.0, "measured")])
def test_pool_is_sized_by_the_plan_and_the_largest_step_runs(sliced_8b, fraction, bound):
    """fraction 1.0: the pool takes everything the measurement leaves, so the largest step (the
    full token budget, every row sampling) and graph decode must still fit."""
    from ketch.engine.engine import Engine
    from ketch.sampling.params import SamplingParams

    _free_cuda()
    rows, prompt = 16, 128
    engine = Engine(EngineConfig(model=sliced_8b, load_format="dummy", dtype="bfloat16", device="cuda",
                                 max_model_len=1024, max_num_seqs=rows, max_num_batched_tokens=rows * prompt,
                                 cuda_graph_max_bs=rows, mem_fraction_static=fraction, seed=0))
    try:
        runner = engine.runner
        p = runner.memory_plan
        assert p is not None and p.profile is not None and p.bound == bound
        assert runner.pool.num_pages == p.num_pages and p.num_pages > 0
        assert p.pool_bytes <= int(p.total * fraction) - p.used_after_load
        assert p.pool_bytes <= p.free - p.peak - p.margin
        assert p.profile.step > 0 and p.profile.graphs > 0  # both were measured
        assert runner.graphs.captured_sizes() == [1, 2, 4, 8, 16]

        step_tokens: list[int] = []
        forward = runner.forward

        def tapped(batch, *args, **kw):
            step_tokens.append(batch.num_tokens)
            return forward(batch, *args, **kw)

        runner.forward = tapped
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        gen = torch.Generator().manual_seed(0)
        for i in range(rows):  # one step of exactly max_num_batched_tokens, every row sampling
            engine.add_request(f"r{i}", torch.randint(0, 128_000, (prompt,), generator=gen).tolist(), params)
        res = collect(drain(engine))
        assert max(step_tokens) == rows * prompt
        assert all(len(res[(f"r{i}", 0)]["ids"]) == 8 for i in range(rows))
    finally:
        del engine
        _free_cuda()
