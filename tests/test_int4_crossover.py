"""Where the 4-bit kernel stops paying, measured per weight shape at start-up (issue 18): the
decision rule, the calibration of real layers (one measurement per shape, every layer of it
set), and the forward taking the 4-bit kernel exactly up to the measured size."""
from __future__ import annotations

import pytest
import torch

from ketch.layers.int4_crossover import MARGIN, SIZES, calibrate, crossover
from ketch.layers.linear import Linear
from ketch.layers.q4 import Q4Weight

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="torch without the int4 CPU kernel")


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
    found = calibrate(layers)
    assert set(found) == {(64, 128), (96, 64)}  # the dense-only layer is not timed
    assert all(n == 0 or n in SIZES for n in found.values())
    assert layers[0].int4_max_tokens == layers[2].int4_max_tokens == found[64, 128]
    assert layers[1].int4_max_tokens == found[96, 64]
    lin = layers[0]
    for limit in (0, 2, 16):  # whatever was measured, the forward switches exactly there
        lin.int4_max_tokens = limit
        for m in (1, 2, 3, 16, 17):
            x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
            want = lin.int4_product(x) if m <= limit else lin.dense_product(x)
            assert torch.equal(lin(x), want), (limit, m)
