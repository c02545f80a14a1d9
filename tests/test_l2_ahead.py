"""kernels/l2_ahead.py: a layer's later weights (o_proj, DeepSeek's shared experts) asked into L2
on a side stream beside the layer's chain. On the CPU: which bytes each site names, the spans'
alignment, a clear error for a bad site or a strided tensor, nothing done off CUDA. On an sm_90
GPU: an engine with the branch on (CUDA graphs, the Triton path) gives the bits of the same engine
without it, the prefetch kernel launched once a layer in each captured one-row forward."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest

pytest.importorskip("triton")

from conftest import greedy_ids_and_logprobs, make_tiny_engine
from engine_cut import cut_config

from ketch.kernels import l2_ahead

ALL_SITES = "o_proj,shared,shared_down"


def test_spans_cover_each_tensor_rounded_out_to_16_bytes():
    base = torch.zeros(64, dtype=torch.float16)
    t = base[3:20]  # starts 6 bytes into the storage, 34 bytes long
    (lo, n), = l2_ahead.spans([t])
    start, end = t.data_ptr(), t.data_ptr() + 34
    assert lo % 16 == 0 and n % 16 == 0
    assert lo <= start < lo + 16 and end <= lo + n < end + 16


def test_a_strided_tensor_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        l2_ahead.spans([torch.zeros(4, 4).t()])


def test_sites_pick_their_tensors_and_a_typo_is_an_error():
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    weights = {"o_proj": [a], "shared": [b], "shared_down": [c]}
    assert l2_ahead.chosen(weights, "shared") == [b]
    assert l2_ahead.chosen(weights, "o_proj,shared_down") == [a, c]
    assert l2_ahead.chosen(weights, "") == []
    with pytest.raises(ValueError, match="SITES.*o_prj"):
        l2_ahead.chosen(weights, "o_prj")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_nothing_is_launched_off_cuda(monkeypatch):
    monkeypatch.setattr(l2_ahead, "SITES", ALL_SITES)
    calls = []
    l2_ahead.ahead(1, lambda: calls.append(1) or {"o_proj": [torch.zeros(8)]})
    l2_ahead.join()
    assert not l2_ahead._pending and not l2_ahead._side


def _layer_weights(name: str, tmp_path) -> tuple[object, list[dict]]:
    engine = make_tiny_engine(cut_config(name, tmp_path), device="cuda" if torch.cuda.is_available() else "cpu",
                              attention_backend="triton", layer_kernels="triton")
    model = engine.runner.model
    return model, [layer.l2_weights() for layer in model.layers]


def test_deepseek_offers_o_proj_and_the_shared_experts_slots(tmp_path):
    model, per_layer = _layer_weights("deepseek-v2-lite", tmp_path)
    cfg = model.config
    for layer, weights in zip(model.layers, per_layer, strict=True):
        assert weights["o_proj"] == [layer.self_attn.o_proj.weight]
        if not cfg.is_moe_layer(layer.self_attn.layer):
            assert set(weights) == {"o_proj"}  # a dense first layer: no experts
            continue
        e = layer.mlp.experts
        (gate_up,), (down,) = weights["shared"], weights["shared_down"]
        # the folded shared MLP's slots, the last n_shared_experts (every token's picks)
        assert gate_up.shape[0] == down.shape[0] == cfg.n_shared_experts == e.shared
        assert gate_up.data_ptr() == e.w13[e.num_experts].data_ptr()
        assert down.data_ptr() == e.w2[e.num_experts].data_ptr()
        assert gate_up.data_ptr() + gate_up.numel() * gate_up.element_size() == \
            e.w13.data_ptr() + e.w13.numel() * e.w13.element_size()  # to the end: all shared slots


def test_a_model_without_shared_experts_offers_o_proj_alone(tmp_path):
    model, per_layer = _layer_weights("qwen3-30b-a3b", tmp_path)
    assert all(w == {"o_proj": [layer.self_attn.o_proj.weight]} for layer, w in zip(model.layers, per_layer,
                                                                                      strict=True))


class _Counting:
    """The prefetch kernel, its launches counted (the JIT function indexed by a grid)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


PROMPTS = [[5, 9, 11, 40, 2, 17, 23], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="cp.async.bulk.prefetch.L2 needs an sm_90 GPU")
@pytest.mark.parametrize("name", ["deepseek-v2-lite", "qwen3-30b-a3b"])
def test_the_branch_leaves_every_bit_as_it_was(name, tmp_path, monkeypatch):
    path = cut_config(name, tmp_path)

    def run(prompts):
        engine = make_tiny_engine(path, device="cuda", attention_backend="triton", layer_kernels="triton",
                                  cuda_graph=True)
        out = greedy_ids_and_logprobs(engine, prompts, 12)
        engine.check_invariants()
        return engine, out

    _, want_one = run(PROMPTS[:1])
    _, want_two = run(PROMPTS)
    monkeypatch.setattr(l2_ahead, "SITES", ALL_SITES)
    counting = _Counting(l2_ahead._l2_prefetch_kernel)
    monkeypatch.setattr(l2_ahead, "_l2_prefetch_kernel", counting)
    engine, got_one = run(PROMPTS[:1])
    assert got_one == want_one  # ids and logprobs, bit for bit
    layers = len(engine.runner.model.layers)
    # one launch a layer in every captured one-row forward (the bs1 graph; eager steps take none)
    assert counting.launches >= layers and counting.launches % layers == 0
    assert not l2_ahead._pending  # every forward joined its branch
    assert run(PROMPTS)[1] == want_two  # two rows a step: the branch is not taken, the bits the same
