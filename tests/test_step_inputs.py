"""What a decode step gathers before its first layer: the input ids (placeholders resolved from
the device's future-token table) and the rotary rows of its positions.

Both run inside every decode CUDA graph, once a step; each torch op there is a launch, and at
batch 1 a launch costs more than its bytes. So besides their values (bit for bit the plain
formulas'), the tests pin how many ops each takes, counted at the dispatcher (what the CUDA
graph records as kernels).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ketch.layers.rotary import RotaryEmbedding
from ketch.layers.yarn import ScaledRotary, YarnScaling
from ketch.runner.future_tokens import FutureTokens, is_placeholder

VIEWS = {"unsqueeze", "view", "_unsafe_view", "reshape", "expand", "slice", "select", "alias", "detach"}


class OpLog(TorchDispatchMode):
    """The names of the non-view aten ops run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


VOCAB = 50


def test_placeholders_of_both_halves_and_real_ids_resolve_to_their_tokens() -> None:
    future = FutureTokens(max_rows=4, vocab_size=VOCAB, device=torch.device("cpu"))
    step_n = future.publish(torch.tensor([7, 0, 49]))
    step_n1 = future.publish(torch.tensor([3, 3, 11, 48]))  # the other half: step N's ids stay
    assert all(is_placeholder(p) for p in step_n + step_n1)
    assert len(set(step_n + step_n1)) == 7
    for dtype in (torch.int32, torch.int64):
        ids = torch.tensor([step_n[2], 0, step_n1[3], VOCAB - 1, step_n[0], 5, step_n1[2]], dtype=dtype)
        got = future.resolve(ids)
        assert got.dtype == torch.int64
        assert got.tolist() == [49, 0, 48, VOCAB - 1, 7, 5, 11]
    step_n2 = future.publish(torch.tensor([21]))  # reuses step N's half: N+1's ids untouched
    assert future.resolve(torch.tensor([step_n2[0], step_n1[0], step_n1[3]])).tolist() == [21, 3, 48]


def test_a_step_of_more_rows_than_a_half_is_refused() -> None:
    future = FutureTokens(max_rows=2, vocab_size=VOCAB, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="3 rows"):
        future.publish(torch.tensor([1, 2, 3]))


def test_resolve_is_one_add_and_one_gather() -> None:
    future = FutureTokens(max_rows=8, vocab_size=VOCAB, device=torch.device("cpu"))
    ids = torch.tensor(future.publish(torch.tensor([4, 5])) + [9], dtype=torch.int32)
    with OpLog() as log:
        future.resolve(ids)
    assert sorted(log.ops) == ["add", "index_select"]


def _rotaries() -> list[torch.nn.Module]:
    yarn = YarnScaling(factor=40.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707)
    return [RotaryEmbedding(16, 300, 10000.0, None), ScaledRotary(8, 300, 10000.0, yarn), ScaledRotary(8, 300, 500.0, None)]


@pytest.mark.parametrize("which", range(3))
def test_rotary_rows_are_the_gathered_fp32_rows_cast_bit_for_bit(which: int) -> None:
    rope = _rotaries()[which]
    positions = torch.tensor([0, 1, 77, 299, 5, 77])
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.bfloat16):  # bf16 again: its cached tables
        for index_dtype in (torch.int32, torch.int64):
            cos, sin = rope.lookup(positions.to(index_dtype), dtype)
            assert cos.dtype == sin.dtype == dtype and cos.shape == (6, 1, rope.cos.shape[1])
            assert torch.equal(cos, rope.cos[positions].unsqueeze(1).to(dtype))
            assert torch.equal(sin, rope.sin[positions].unsqueeze(1).to(dtype))


def test_a_step_gathers_its_rotary_rows_in_two_ops_once_the_tables_are_cast() -> None:
    rope = _rotaries()[0]
    positions = torch.tensor([3, 9], dtype=torch.int32)
    rope.lookup(positions, torch.bfloat16)  # the first lookup in a dtype casts the tables (eager warm-up)
    for dtype in (torch.bfloat16, torch.float32):
        with OpLog() as log:
            rope.lookup(positions, dtype)
        assert log.ops == ["index_select", "index_select"], dtype
