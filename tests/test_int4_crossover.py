"""Where the 4-bit kernel stops paying, measured per weight shape at start-up (issue 18): the
decision rule, the calibration of real layers (one measurement per shape, every layer of it
set), the forward taking the 4-bit kernel exactly up to the measured size, and the per-machine
cache of clean measurements (what it is keyed on, what it refuses)."""
from __future__ import annotations

import pytest
import torch

from ketch.layers import int4_crossover
from ketch.layers import int4_crossover_cache as cache
from ketch.layers.int4_crossover import MARGIN, NOISE, SIZES, calibrate, crossover, noisy
from ketch.layers.linear import Linear
from ketch.layers.q4 import Q4Weight

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="torch without the int4 CPU kernel")


@pytest.fixture(autouse=True)
def fresh_process_memory(monkeypatch):
    """Each test starts as a fresh process would: no measurement taken earlier in it, and no
    crossover pinned (conftest pins one for the rest of the suite)."""
    monkeypatch.setattr(int4_crossover, "_MEASURED_HERE", {})
    monkeypatch.delenv("KETCH_INT4_CROSSOVER", raising=False)


def test_the_crossover_is_the_last_size_of_an_unbroken_run_of_wins():
    dense = [1.0] * 4
    assert crossover([0.5, 0.5, 0.5, 0.5], dense, (1, 2, 4, 8)) == 8  # won every size timed
    assert crossover([0.5, 0.5, 2.0, 0.5], dense, (1, 2, 4, 8)) == 2  # a later win after a loss does not count
    assert crossover([2.0, 0.5], dense[:2], (1, 2)) == 0  # lost at one token: dense everywhere
    assert crossover([MARGIN, 0.5], dense[:2], (1, 2)) == 0  # a near tie is not a win
    assert crossover([0.5], dense[:1], (1, 2, 4)) == 1  # timing stopped early: the sizes timed count


def q4_linear(out_features: int, in_features: int, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    w = Q4Weight(torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.int32),
                 torch.rand(out_features, in_features // 32, generator=g) / 8,
                 torch.rand(out_features, in_features // 32, generator=g) / 8)
    lin = Linear(in_features, out_features, bias=False)
    lin.weight.data = w.dequantize().to(torch.bfloat16)
    lin.attach_int4(w)
    return lin.to(torch.bfloat16)


def test_calibration_measures_each_shape_once_and_the_forward_follows_it(one_torch_thread):
    layers = [q4_linear(64, 128, 0), q4_linear(96, 64, 1), q4_linear(64, 128, 2), Linear(32, 32)]
    found, source = calibrate(layers)
    assert source in ("measured", "measured under load, kept for this process only", "cached")
    assert set(found) == {(64, 128), (96, 64)}  # the dense-only layer is not timed
    assert all(n == 0 or n in SIZES for n in found.values())
    # the layer's limit from its shape's crossover (unbounded where 4-bit won every size timed: AVX2)
    assert layers[0].int4_max_tokens == layers[2].int4_max_tokens == int4_crossover.steps_up_to(found[64, 128])
    assert layers[1].int4_max_tokens == int4_crossover.steps_up_to(found[96, 64])
    lin = layers[0]
    for limit in (0, 2, 16):  # whatever was measured, the forward switches exactly there
        lin.int4_max_tokens = limit
        for m in (1, 2, 3, 16, 17):
            x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
            want = lin.int4_product(x) if m <= limit else lin.dense_product(x)
            assert torch.equal(lin(x), want), (limit, m)


def test_runs_that_disagree_mark_a_measurement_taken_under_load():
    assert not noisy([1.0, 1.2, NOISE * 0.99])
    assert noisy([1.0, 1.1, NOISE * 1.01])


def test_a_kept_crossover_is_read_back_only_for_the_same_machine_settings(monkeypatch):
    shapes = {(64, 128): 4, (96, 64): 32}
    cache.store(shapes, torch.bfloat16)
    assert cache.load(list(shapes), torch.bfloat16) == shapes
    assert cache.load(list(shapes), torch.float16) is None  # another dtype
    assert cache.load([(64, 128)], torch.bfloat16) is None  # another model's shapes
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # an emulated ISA is another machine
    assert cache.load(list(shapes), torch.bfloat16) is None
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)  # other threads, other timings
    try:
        assert cache.load(list(shapes), torch.bfloat16) is None
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("KETCH_INT4_CROSSOVER", "measure")
    assert cache.load(list(shapes), torch.bfloat16) is None
    monkeypatch.delenv("KETCH_INT4_CROSSOVER")
    path = cache.cache_path(list(shapes), torch.bfloat16)
    for bad in ("{", '{"64x128": 4}', '{"64x128": 4, "96x64": -1}', "[1, 2]"):  # torn, incomplete, negative, not a map
        path.write_text(bad)
        assert cache.load(list(shapes), torch.bfloat16) is None, bad


def test_calibration_takes_the_kept_crossover_instead_of_timing(one_torch_thread, monkeypatch):
    """Sizes no measurement here would give (4 and 32 for these tiny shapes) come back from the
    cache and set the layers; asked to measure, it times again."""
    layers = [q4_linear(64, 128, 0), q4_linear(96, 64, 1)]
    cache.store({(64, 128): 4, (96, 64): 32}, torch.bfloat16)
    found, source = calibrate(layers)
    assert source == "cached" and found == {(64, 128): 4, (96, 64): 32}
    assert (layers[0].int4_max_tokens, layers[1].int4_max_tokens) == (4, 32)
    monkeypatch.setenv("KETCH_INT4_CROSSOVER", "measure")
    found, source = calibrate(layers)
    assert source.startswith("measured")
    monkeypatch.delenv("KETCH_INT4_CROSSOVER")
    kept = cache.load(list(found), torch.bfloat16)  # a clean measurement replaced the file, one under load did not
    assert kept == (found if source == "measured" else {(64, 128): 4, (96, 64): 32})


def test_a_measurement_under_load_is_reused_by_every_later_engine_of_the_process(one_torch_thread, monkeypatch,
                                                                                 tmp_path):
    """Not on disk (another start-up measures for itself), but this process's next engine takes the
    same kernels, hence the same bf16 rounding, instead of timing again under other load."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a machine with nothing kept yet
    monkeypatch.setattr(int4_crossover, "NOISE", 0.5)  # every set of runs now reads as taken under load
    first = [q4_linear(64, 128, 0), q4_linear(96, 64, 1)]
    found, source = calibrate(first)
    assert source == "measured under load, kept for this process only"
    assert cache.load(list(found), torch.bfloat16) is None  # nothing written for other processes
    second = [q4_linear(64, 128, 3), q4_linear(96, 64, 4)]  # another engine's layers, same shapes
    for layer in second:
        layer.int4_max_tokens = -1
    again, source = calibrate(second)
    assert source == "measured earlier in this process" and again == found
    assert [m.int4_max_tokens for m in second] == [m.int4_max_tokens for m in first]
    monkeypatch.setenv("KETCH_INT4_CROSSOVER", "measure")  # asked to measure: it times again
    assert calibrate(second)[1].startswith("measured under load")


def test_a_dense_gemm_that_lost_at_every_size_is_never_taken():
    """The crossover hit the largest size timed: the 4-bit kernel takes every step (prefill too)."""
    from ketch.layers.int4_crossover import SIZES, steps_up_to

    assert steps_up_to(SIZES[-1]) > 1 << 40
    assert steps_up_to(SIZES[-2]) == SIZES[-2] and steps_up_to(0) == 0


def test_a_pinned_crossover_sets_every_shape_without_timing_or_the_cache(one_torch_thread, monkeypatch):
    """KETCH_INT4_CROSSOVER=<tokens>: every layer takes the 4-bit kernel up to that many tokens
    whatever the cache holds and without timing (a machine that never times clean then starts
    alike every time); anything but a count or 'measure' is refused, naming the variable."""
    layers = [q4_linear(64, 128, 0), q4_linear(96, 64, 1)]
    cache.store({(64, 128): 4, (96, 64): 32}, torch.bfloat16)
    monkeypatch.setenv("KETCH_INT4_CROSSOVER", "12")
    found, source = calibrate(layers)
    assert found == {(64, 128): 12, (96, 64): 12} and source == "pinned by KETCH_INT4_CROSSOVER=12"
    assert [m.int4_max_tokens for m in layers] == [12, 12]
    assert cache.load(list(found), torch.bfloat16) == {(64, 128): 4, (96, 64): 32}  # the cache untouched
    monkeypatch.setenv("KETCH_INT4_CROSSOVER", "twelve")
    with pytest.raises(ValueError, match="KETCH_INT4_CROSSOVER"):
        calibrate(layers)
