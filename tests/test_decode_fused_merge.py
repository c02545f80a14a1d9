"""The decode split launch merging its own partials (KETCH_DECODE_FUSED_MERGE,
kernels/decode_attention.py): the last split program of each kv head to take its ticket merges,
bit-equal to the merge launch in the interpreter; the tickets are checked and left zero; a batch-1
engine runs no merge launch and keeps the torch tokens. (The Triton backend with the switch on
and off against the torch backend: tests/test_kernels.py.)"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from test_kernels import DEVICE, D, H, KVH, close, page_tables, random_pool  # noqa: E402

from ketch.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402


@pytest.mark.parametrize("num_splits", [1, 3, 8, 16, 17])
def test_decode_fused_merge_gives_the_merge_launchs_output(num_splits: int) -> None:
    """The split launch merging its own partials (the last split of each kv head to finish)
    writes what the separate merge launch writes: bit-equal in the interpreter (the same formula,
    the programs run in order there), within fp32 rounding natively (another reduction layout);
    the counters are zero again after every launch, so a second launch (a graph replay) with
    the same buffer is right too; 17 splits: past the one compiled split tile."""
    gen = torch.Generator().manual_seed(num_splits)
    lens = [1, 7, 200, 33, 0, 128]  # an empty row; 7 leaves most splits empty
    kc, vc = random_pool(64, 16, torch.float32, gen)
    table = page_tables(lens, 16, 64, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    tickets = torch.zeros(len(lens) * KVH + 3, dtype=torch.int32, device=DEVICE)  # more than needed: fine
    outs = []
    for _ in range(2):
        q = torch.randn(len(lens), H, D, generator=gen).to(DEVICE)
        two = decode_attention(q, kc, vc, table, seq_lens, D**-0.5, num_splits=num_splits, block_n=16,
                               fused_merge=False)
        one = decode_attention(q, kc, vc, table, seq_lens, D**-0.5, num_splits=num_splits, block_n=16,
                               fused_merge=True, tickets=tickets)
        assert not tickets.any()
        if DEVICE.type == "cpu":
            assert torch.equal(one, two)
        close(one, two, torch.float32)
        close(one, decode_attention_ref(q, kc, vc, table, seq_lens, D**-0.5), torch.float32)
        outs.append(one)
    assert not torch.equal(outs[0], outs[1])  # two different steps, both right


def test_decode_fused_merge_checks_its_tickets() -> None:
    gen = torch.Generator().manual_seed(0)
    kc, vc = random_pool(8, 16, torch.float32, gen)
    table = page_tables([20, 5], 16, 8, gen)
    seq_lens = torch.tensor([20, 5], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, H, D, generator=gen).to(DEVICE)
    for bad in (torch.zeros(2 * KVH - 1, dtype=torch.int32), torch.zeros(2 * KVH, dtype=torch.int64)):
        with pytest.raises(ValueError, match="tickets"):
            decode_attention(q, kc, vc, table, seq_lens, 0.1, num_splits=2, fused_merge=True, tickets=bad.to(DEVICE))


@pytest.mark.parametrize("fused_merge", [False, True])
def test_a_batch_one_engine_with_the_fused_decode_merge_keeps_the_torch_tokens(fused_merge: bool, tmp_path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """KETCH_DECODE_FUSED_MERGE: a Qwen3-MoE engine (GQA) at batch 1 on the Triton kernels, two
    decode splits fixed, keeps the torch path's greedy tokens, and no merge launch runs (without
    the switch one runs per layer and decode step: the watch sees them)."""
    from engine_cut import assert_same_tokens, batch_one_on_both_paths, cut_config
    from ketch.attention import triton_backend as tb
    from ketch.kernels import decode_attention as da
    monkeypatch.setattr(da, "FUSED_MERGE", fused_merge)
    real_init = tb.TritonAttentionBackend.__init__

    def two_splits(self, *args, **kwargs):
        real_init(self, *args, **{**kwargs, "decode_splits": 2})

    monkeypatch.setattr(tb.TritonAttentionBackend, "__init__", two_splits)
    want, got, rows = batch_one_on_both_paths(cut_config("qwen3-30b-a3b", tmp_path), DEVICE.type, da,
                                              "merge_splits", 5)
    assert rows == ([] if fused_merge else [1] * (2 * 4))  # 2 layers x the 4 decode steps after the prefill
    assert_same_tokens(want, got)
