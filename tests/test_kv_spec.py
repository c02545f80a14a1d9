"""KVSpec: what a model keeps per token, and the pool built from it (MHA "k"/"v", or one MLA-like
latent per layer), its bytes, its dtype rules, and the errors that name the field."""
from __future__ import annotations

import pytest
import torch

from ketch.cache.kv_pool import KVPool
from ketch.config import KVSpec, KVTensorSpec
from ketch.kv_dtype import FP8_E4M3_MAX
from ketch.models import family_for, load_model_config
from ketch.parallel import SINGLE, ParallelContext

FP8 = torch.float8_e4m3fn
# DeepSeek-V3's MLA cache: one compressed latent (kv_lora_rank 512) + the shared rope key (64)
MLA = KVSpec(61, (KVTensorSpec("latent", (512 + 64,)),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_smollm2_bytes_per_token_from_its_family_spec(dtype):
    cfg = load_model_config(None)  # the bundled SmolLM2-135M: 30 layers, 3 kv heads of 64
    spec = family_for(cfg.architecture).kv_spec(cfg, SINGLE)
    assert spec.names == ("k", "v") and spec.num_layers == 30
    want = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    assert spec.bytes_per_token(dtype, torch.bfloat16) == want == 2 * 30 * 3 * 64 * dtype.itemsize
    # each of 3 ranks keeps one kv head: a third of the bytes
    assert family_for(cfg.architecture).kv_spec(cfg, ParallelContext(2, 3)).bytes_per_token(dtype) * 3 == want


def test_mla_like_spec_has_its_own_figure():
    assert MLA.bytes_per_token(torch.bfloat16) == 61 * 576 * 2
    assert MLA.bytes_per_token(FP8, torch.bfloat16) == 61 * 576
    assert MLA.bytes_per_page(16, torch.bfloat16) == 16 * 61 * 576 * 2
    mha = KVSpec.mha(61, 128, 128)  # the same model with plain K/V would keep 57x more
    assert mha.bytes_per_token(torch.bfloat16) == 2 * 61 * 128 * 128 * 2


def test_dtype_rules_kv_model_and_fixed():
    spec = KVSpec(2, (KVTensorSpec("x", (4,)), KVTensorSpec("y", (4,), "model"),
                      KVTensorSpec("scale", (1,), torch.float32)))
    # fp8 pages narrow only the "kv" tensor
    assert spec.bytes_per_token(FP8, torch.bfloat16) == 2 * (4 * 1 + 4 * 2 + 1 * 4)
    pool = KVPool(spec, 3, 2, FP8, "cpu", compute_dtype=torch.bfloat16)
    assert [pool.tensor(1, n).dtype for n in spec.names] == [FP8, torch.bfloat16, torch.float32]
    assert pool.bytes_per_token == spec.bytes_per_token(FP8, torch.bfloat16)
    assert pool.bytes_per_page * 3 == sum(t.numel() * t.element_size() for layer in pool.layers for t in layer.values())


def test_pool_of_one_latent_per_layer_writes_and_reads_by_name():
    spec = KVSpec(3, (KVTensorSpec("latent", (6,)),))
    pool = KVPool(spec, num_pages=4, page_size=2, dtype=FP8, device="cpu", compute_dtype=torch.float32)
    assert [sorted(layer) for layer in pool.layers] == [["latent"]] * 3
    assert pool.tensor(2, "latent").shape == (4, 2, 6)
    x = torch.randn(3, 6) * 100
    x[0, 0] = 1e6  # beyond e4m3's range: saturates
    pool.write(1, "latent", torch.tensor([7, 0, 4]), x)
    got = pool.read_pages(1, "latent", torch.tensor([[3, 0], [2, 2]]))  # [batch 2, 2 pages * 2 slots]
    assert got.dtype == torch.float32 and got.shape == (2, 4, 6)
    want = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8).float()
    assert torch.equal(got[0, 1], want[0]) and torch.equal(got[0, 2], want[1]) and torch.equal(got[1, 0], want[2])
    assert got[0, 1, 0] == FP8_E4M3_MAX
    assert not pool.tensor(0, "latent").any()  # other layers untouched
    with pytest.raises(AttributeError, match="declares no 'k' tensor.*latent"):
        pool.k


def test_mha_pool_keeps_k_and_v_lists_over_the_named_tensors():
    pool = KVPool(KVSpec.mha(2, 2, 4), 3, 4, torch.float32, "cpu")
    assert all(pool.k[i] is pool.tensor(i, "k") and pool.v[i] is pool.tensor(i, "v") for i in range(2))
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    pool.store(1, torch.tensor([5, 11]), k, v)
    kc, vc = pool.gather(1, torch.tensor([[1, 2]]))
    assert torch.equal(kc[0, 1], k[0]) and torch.equal(vc[0, 7], v[1])


@pytest.mark.parametrize("make, field", [
    (lambda: KVSpec(0, (KVTensorSpec("k", (1,)),)), "num_layers"),
    (lambda: KVSpec(1, ()), "tensors"),
    (lambda: KVSpec(1, (KVTensorSpec("k", (1,)), KVTensorSpec("k", (2,)))), "unique"),
    (lambda: KVTensorSpec("k", (2, 0)), "shape"),
    (lambda: KVTensorSpec("", (2,)), "name"),
    (lambda: KVTensorSpec("k", (2,), "fp8"), "dtype"),
])
def test_bad_specs_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()
