"""MLA's Triton path (issue 19) against the torch reference (ketch/attention/mla_backend.py).

Kernels: `mla_decode` (absorbed form, latent space) vs `mla_decode_ref` and, through W_UV, vs
`mla_absorbed`; `extend_attention` with a v dim other than the qk dim (MLA's expanded form);
`store_rows`. Backend: MLATritonBackend vs MLAAttentionBackend on mixed steps (decode rows, a
chunk after a cached prefix, a fresh prompt) and through the decode-graph hooks (padded rows).
Small dims (rank 64 + rope 16), page size 16, pages scattered. Without CUDA the kernels run in
Triton's CPU interpreter, fp32 and fp16 only (its bf16 is wrong).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ketch.attention.mla_backend import MLAAttentionBackend, mla_absorbed  # noqa: E402
from ketch.attention.mla_triton_backend import MLATritonBackend  # noqa: E402
from ketch.cache.kv_pool import KVPool  # noqa: E402
from ketch.config import KVSpec, KVTensorSpec  # noqa: E402
from ketch.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from ketch.kernels.extend_attention import extend_attention, extend_attention_ref  # noqa: E402
from ketch.kernels.kv_store import store_rows, store_rows_ref  # noqa: E402
from ketch.kernels.mla_decode import mla_decode, mla_decode_ref, mla_num_splits  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
RANK, ROPE, NOPE, VDIM, PAGE = 64, 16, 32, 24, 16


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype] * scale, rtol=TOL[dtype] * scale)


def page_table(lens: list[int], num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Disjoint shuffled pages per sequence (a wrong lookup reads another's latents), padded with page 0."""
    need = [-(-n // PAGE) for n in lens]
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(lens), max(1, max(need)), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n]
        used += n
    return table.to(DEVICE)


def weights(heads: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w_uk [heads, nope, rank], w_uv [heads, v, rank]: views of one kv_b_proj weight, as the model passes them."""
    w = (torch.randn(heads, NOPE + VDIM, RANK, generator=gen) / 8).to(DEVICE, dtype)
    return w[:, :NOPE], w[:, NOPE:]


LENS = [1, 16, 37, 70, 5]  # one token, a whole page, non-multiples of the page


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,splits", [(4, 1), (16, 3), (12, 16)])
def test_mla_decode_matches_reference(dtype: torch.dtype, heads: int, splits: int) -> None:
    gen = torch.Generator().manual_seed(heads)
    table = page_table(LENS, 24, gen)
    cache = torch.randn(24, PAGE, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    q_lat = (torch.randn(len(LENS), heads, RANK, generator=gen) / 4).to(DEVICE, dtype)
    q_pe = torch.randn(len(LENS), heads, ROPE, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(LENS, dtype=torch.int32, device=DEVICE)
    out = mla_decode(q_lat, q_pe, cache, table, lens, 0.15, num_splits=splits, block_n=16)
    close(out, mla_decode_ref(q_lat, q_pe, cache, table, lens, 0.15), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_past_one_merge_tile_writes_and_reads_only_the_nonempty_splits(dtype: torch.dtype) -> None:
    """More splits than decode_attention.MERGE_BLOCK (a long context at a small batch): an empty
    split writes its lse alone, and both consumers (the merge, and at one row the W_UV product
    that merges itself) read the nonempty ones only. The scratch starts as NaN, so a partial that
    was read but never written shows."""
    from ketch.kernels.decode_attention import MERGE_BLOCK, decode_scratch
    from ketch.kernels.head_gemv import head_gemv
    from ketch.kernels.mla_decode import mla_decode_partials

    gen, heads, splits = torch.Generator().manual_seed(5), 16, 2 * MERGE_BLOCK + 1
    lens = [300, 1, 0]  # 300: 19 nonempty splits of 16 tokens; 1: one; 0: a padded row
    table = page_table(lens, 48, gen)
    cache = torch.randn(48, PAGE, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    q_lat = (torch.randn(len(lens), heads, RANK, generator=gen) / 4).to(DEVICE, dtype)
    q_pe = torch.randn(len(lens), heads, ROPE, generator=gen).to(DEVICE, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)

    def nan_scratch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        mid_o, mid_lse = decode_scratch(batch, heads, RANK, splits, DEVICE)
        return mid_o.fill_(float("nan")), mid_lse.fill_(float("nan"))

    ref = mla_decode_ref(q_lat, q_pe, cache, table, seq_lens, 0.15)
    out = mla_decode(q_lat, q_pe, cache, table, seq_lens, 0.15, scratch=nan_scratch(len(lens)), num_splits=splits,
                     block_n=16)
    close(out, ref, dtype)
    assert torch.count_nonzero(out[2]) == 0
    w_uv = weights(heads, gen, dtype)[1]
    parts, lse = mla_decode_partials(q_lat[:1], q_pe[:1], cache, table[:1], seq_lens[:1], 0.15,
                                     scratch=nan_scratch(1), num_splits=splits, block_n=16)
    assert parts[0, :, 19:].isnan().all() and (lse[0, :, 19:] == float("-inf")).all()
    merged = head_gemv(parts, w_uv.transpose(1, 2), out=torch.empty(1, heads, VDIM, dtype=dtype, device=DEVICE),
                       lse=lse, seq_lens=seq_lens[:1], split_block=16)
    close(merged[0], torch.einsum("hr,hvr->hv", ref[0], w_uv), dtype, scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_with_w_uv_is_the_absorbed_form(dtype: torch.dtype) -> None:
    """q_nope W_UK in, W_UV out: mla_backend.py's `mla_absorbed` over the gathered, masked pages;
    a padded row (length 0) gives zeros."""
    gen, heads, scale = torch.Generator().manual_seed(1), 8, 0.12
    lens = LENS + [0]
    table = page_table(lens, 24, gen)
    cache = torch.randn(24, PAGE, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(lens), heads, NOPE + ROPE, generator=gen).to(DEVICE, dtype)
    w_uk, w_uv = weights(heads, gen, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q_lat = torch.einsum("bhn,hnr->bhr", q[..., :NOPE], w_uk)
    o_lat = mla_decode(q_lat, q[..., NOPE:], cache, table, seq_lens, scale, num_splits=2, block_n=16)
    out = torch.einsum("bhr,hvr->bhv", o_lat, w_uv)
    width = table.shape[1] * PAGE
    lat = cache[table.long()].view(len(lens), width, RANK + ROPE)
    visible = torch.arange(width, device=DEVICE)[None, :] < seq_lens[:, None]
    mask = torch.zeros(visible.shape, device=DEVICE).masked_fill(~visible, float("-inf"))[:, None, None]
    ref = mla_absorbed(q[:, :, None].float(), lat.float(), mask, w_uk.float(), w_uv.float(), scale)[:, :, 0]
    close(out[:-1], ref[:-1], dtype, scale=2)
    assert torch.count_nonzero(out[-1]) == 0


def test_mla_splits_count_head_blocks() -> None:
    assert mla_num_splits(1, 16, 4096, block_h=16, block_n=32, target_programs=264) == 16
    assert mla_num_splits(128, 16, 4096, block_h=16, block_n=32, target_programs=264) == 3
    assert mla_num_splits(8, 128, 40, block_h=16, block_n=32) == 1  # never a split under two blocks


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_attention_with_a_narrower_value_dim(dtype: torch.dtype) -> None:
    """MLA's expanded form: qk dim nope + rope = 48, v dim 24, MHA (kv heads = heads)."""
    gen, heads, qk = torch.Generator().manual_seed(2), 4, NOPE + ROPE
    prefix, new = [0, 21, 16], [9, 5, 17]
    table = page_table([p + n for p, n in zip(prefix, new)], 12, gen)
    kc = torch.randn(12, PAGE, heads, qk, generator=gen).to(DEVICE, dtype)
    vc = torch.randn(12, PAGE, heads, VDIM, generator=gen).to(DEVICE, dtype)
    tokens = sum(new)
    q, k = (torch.randn(tokens, heads, qk, generator=gen).to(DEVICE, dtype) for _ in range(2))
    v = torch.randn(tokens, heads, VDIM, generator=gen).to(DEVICE, dtype)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    q_starts = as_t([sum(new[:i]) for i in range(len(new))])
    args = (q, k, v, kc, vc, table, as_t(prefix), as_t(new), q_starts)
    out = extend_attention(*args, max(new), 0.2, block_m=16, block_n=16)
    assert out.shape == (tokens, heads, VDIM)
    close(out, extend_attention_ref(*args, 0.2), dtype)


def test_store_rows_writes_each_slot_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(3)
    caches = [torch.zeros(4, PAGE, RANK + ROPE, device=DEVICE) for _ in range(2)]
    x = torch.randn(5, RANK + ROPE, generator=gen).to(DEVICE)
    slots = torch.tensor([3, 40, -1, 17, 63], dtype=torch.int32, device=DEVICE)
    store_rows(caches[0], x, slots)
    store_rows_ref(caches[1], x, slots)
    assert torch.equal(caches[0], caches[1]) and torch.count_nonzero(caches[0]) == 4 * (RANK + ROPE)


# ---------------------------------------------------------------- backend end to end


def backends(heads: int, dtype: torch.dtype, num_pages: int, gen: torch.Generator, layers: int = 2,
             kv_dtype: torch.dtype | None = None):
    spec = KVSpec(layers, (KVTensorSpec("latent", (RANK + ROPE,)),))
    pools = [KVPool(spec, num_pages, PAGE, kv_dtype or dtype, DEVICE, compute_dtype=dtype) for _ in range(2)]
    for layer in range(layers):  # the same history in both pools
        pools[0].tensor(layer, "latent").copy_(torch.randn(num_pages, PAGE, RANK + ROPE, generator=gen))
        pools[1].tensor(layer, "latent").copy_(pools[0].tensor(layer, "latent"))
    ref = MLAAttentionBackend(pools[0], "latent", 0.13, DEVICE)
    tri = MLATritonBackend(pools[1], "latent", heads, RANK, 0.13, DEVICE, decode_block_n=16,
                           extend_block_m=16, extend_block_n=16)
    return pools, ref, tri


def layer_inputs(tokens: int, heads: int, dtype: torch.dtype, gen: torch.Generator):
    q = torch.randn(tokens, heads, NOPE + ROPE, generator=gen).to(DEVICE, dtype)
    return q, torch.randn(tokens, RANK + ROPE, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype,kv_dtype", [(d, None) for d in DTYPES] + [(DTYPES[-1], torch.float8_e4m3fn)],
                         ids=[str(d)[6:] for d in DTYPES] + ["fp8-pool"])
def test_mla_triton_backend_matches_torch_backend(dtype: torch.dtype, kv_dtype: torch.dtype | None) -> None:
    """fp8 pool: both read cached latents cast up and a chunk's own new latents at full precision."""
    gen, heads, layers = torch.Generator().manual_seed(4), 16, 2
    pools, ref, tri = backends(heads, dtype, 40, gen, layers, kv_dtype)
    w = [weights(heads, gen, dtype) for _ in range(layers)]
    perm = torch.randperm(40, generator=gen).tolist()
    steps = [
        [  # decodes (one a 1-token prompt), a chunk after a cached prefix, a fresh prompt
            SeqChunk(start=40, num_new=1, page_table=perm[0:3]),
            SeqChunk(start=0, num_new=1, page_table=perm[3:4]),
            SeqChunk(start=17, num_new=1, page_table=perm[4:6]),
            SeqChunk(start=21, num_new=13, page_table=perm[6:9]),
            SeqChunk(start=0, num_new=11, page_table=perm[9:10]),
            SeqChunk(start=32, num_new=3, page_table=perm[10:13]),
        ],
        [SeqChunk(start=0, num_new=20, page_table=perm[13:15])],  # prefill only, nothing cached
        [SeqChunk(start=34, num_new=1, page_table=perm[6:9]), SeqChunk(start=11, num_new=1, page_table=perm[9:10])],
        # one decode row (the W_UV product merges the splits itself), with and without an extend
        [SeqChunk(start=41, num_new=1, page_table=perm[0:3]), SeqChunk(start=5, num_new=4, page_table=perm[15:16])],
        [SeqChunk(start=42, num_new=1, page_table=perm[0:3])],
    ]
    for seqs in steps:
        batch = ForwardBatch.build(seqs, PAGE)
        ref_meta, tri_meta = ref.init_metadata(batch), tri.init_metadata(batch)
        for layer in range(layers):
            q, latent = layer_inputs(batch.num_tokens, heads, dtype, gen)
            got = tri.forward(q, latent, layer, tri_meta, *w[layer])
            want = ref.forward(q, latent, layer, ref_meta, *w[layer])
            close(got, want, dtype, scale=2)
    for layer in range(layers):
        assert torch.equal(pools[0].tensor(layer, "latent"), pools[1].tensor(layer, "latent"))


def test_mla_triton_backend_with_more_splits_than_one_merge_tile_matches_torch() -> None:
    """max_splits 64 with the splits sized for a 4,096-token context, as a graph of a long-context
    server sizes them: short sequences leave most splits empty (no partial written, none read),
    at one decode row (W_UV merges) and at two (the merge kernel), against the torch backend."""
    gen, heads = torch.Generator().manual_seed(8), 16
    pools, ref, _ = backends(heads, torch.float32, 40, gen, layers=1)
    tri = MLATritonBackend(pools[1], "latent", heads, RANK, 0.13, DEVICE, decode_block_n=16, max_splits=64,
                           decode_splits_len=4096)
    w = weights(heads, gen, torch.float32)
    perm = torch.randperm(40, generator=gen).tolist()
    for seqs in ([SeqChunk(start=300, num_new=1, page_table=perm[0:19])],
                 [SeqChunk(start=300, num_new=1, page_table=perm[0:19]), SeqChunk(start=4, num_new=1,
                                                                                  page_table=perm[19:20])]):
        batch = ForwardBatch.build(seqs, PAGE)
        tri_meta = tri.init_metadata(batch)
        assert tri_meta.decode.num_splits == 64
        q, latent = layer_inputs(batch.num_tokens, heads, torch.float32, gen)
        close(tri.forward(q, latent, 0, tri_meta, *w), ref.forward(q, latent, 0, ref.init_metadata(batch), *w),
              torch.float32, scale=2)


def test_mla_short_shape_takes_16_row_tiles_at_one_short_row_and_matches_torch() -> None:
    """The default tiles (32 rows; the short shape's 16) with graphs sized for 4,096 tokens: one
    decode row within SHORT_SPAN runs one 16-row split per 16 tokens of the span (the W_UV product
    merging them); past the span, or at two rows, the long shape. All equal the torch backend.
    The graphs of a size hold both shapes, and a step's key is the shape it runs."""
    from ketch.attention import triton_backend

    gen, heads = torch.Generator().manual_seed(9), 16
    pools, ref, _ = backends(heads, torch.float32, 48, gen, layers=1)
    tri = MLATritonBackend(pools[1], "latent", heads, RANK, 0.13, DEVICE, decode_splits_len=4096)
    span = triton_backend.SHORT_SPAN
    short, long = (span // 16, 16), (64, 32)  # 64: 4,096 tokens in splits of two 32-row tiles, MAX_SPLITS
    assert [tri.decode_shape(1, n) for n in (1, span, span + 1)] == [short, short, long]
    assert tri.decode_shape(2, 5) == long
    assert tri.init_capture([1, 2], max_model_len=4096) == [(1, *short), (1, *long), (2, *long)]
    w = weights(heads, gen, torch.float32)
    perm = torch.randperm(48, generator=gen).tolist()
    cases = [([SeqChunk(start=span - 1, num_new=1, page_table=perm[0:span // PAGE])], short),
             ([SeqChunk(start=span, num_new=1, page_table=perm[0:span // PAGE + 1])], long),
             ([SeqChunk(start=40, num_new=1, page_table=perm[20:23]), SeqChunk(start=4, num_new=1,
                                                                                page_table=perm[23:24])], long)]
    for seqs, shape in cases:
        batch = ForwardBatch.build(seqs, PAGE)
        meta = tri.init_metadata(batch)
        assert (meta.decode.num_splits, meta.decode.block_n) == shape
        assert tri.graph_key(batch, len(seqs)) == (len(seqs), *shape)
        q, latent = layer_inputs(batch.num_tokens, heads, torch.float32, gen)
        close(tri.forward(q, latent, 0, meta, *w), ref.forward(q, latent, 0, ref.init_metadata(batch), *w),
              torch.float32, scale=2)


def test_mla_triton_decode_graph_inputs_match_eager_and_padding_writes_nothing() -> None:
    """The inherited graph hooks with a [heads, rank] scratch: a step of 3 rows through a size-4
    graph's static buffers computes the eager step's rows; the padded row writes no latent."""
    gen, heads = torch.Generator().manual_seed(6), 8
    pools, _, tri = backends(heads, torch.float32, 16, gen, layers=1)
    w_uk, w_uv = weights(heads, gen, torch.float32)
    keys = tri.init_capture([1, 2, 4], max_model_len=64)
    assert [key[0] for key in keys] == [1, 2, 4]  # a context within the short span: one shape a size
    seqs = [SeqChunk(start=30, num_new=1, page_table=[3, 7]), SeqChunk(start=0, num_new=1, page_table=[9]),
            SeqChunk(start=47, num_new=1, page_table=[1, 12, 5])]
    batch = ForwardBatch.build(seqs, PAGE, input_ids=[5, 6, 7])
    key = tri.graph_key(batch, 4)
    assert key == keys[-1]
    tri.prepare_capture(key)
    q, latent = layer_inputs(4, heads, torch.float32, gen)
    before = pools[1].tensor(0, "latent").clone()
    eager = tri.forward(q[:3], latent[:3], 0, tri.init_metadata(batch), w_uk, w_uv)
    pools[1].tensor(0, "latent").copy_(before)
    tri.prepare_replay(batch, key)
    inputs = tri.capture_inputs(key)
    assert inputs.ids.tolist() == [5, 6, 7, 0] and inputs.positions.tolist() == [30, 0, 47, 0]
    graphed = tri.forward(q, latent, 0, inputs.metadata, w_uk, w_uv)
    torch.testing.assert_close(graphed[:3], eager, atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(graphed[3]) == 0
    changed = (pools[1].tensor(0, "latent") != before).any(-1).nonzero().tolist()
    assert changed == [[5, 15], [7, 14], [9, 0]]  # the three new tokens' slots only


def test_mla_kernels_compile_for_sm90_without_spills() -> None:
    """DeepSeek-V2-Lite shapes (16 heads, rank 512 + rope 64, qk 192 / v 128) for an sm_90 target
    (the ptxas in the triton wheel, no GPU needed), with the router's one-token product (bf16 x,
    fp32 weight) and the absorbed per-head products: no spills, nothing stored or loaded before
    the PDL wait but the products' first weight tiles (parameters, prefetched) and, where more
    splits than one merge tile are merged, the row's seq len (written by the step's host copy)."""
    import re
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "ketch.kernels.compile_check", "--arch", "90", "--mla"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"^(\w+)\s+registers\s+\d+\s+spilled (\d+) B  before PDL wait: (.*)$", proc.stdout, re.MULTILINE)
    # parameters before the wait: K step 0's weight tile, mla_prepare's norm weight
    weights_first = {"router_m1", "head_gemv_uk", "head_gemv_uv", "head_gemv_uv_merged", "head_gemv_uv_merged_blocks",
                     "mla_prepare", "mla_prepare_absorb"}
    assert {name for name, _, _ in found} == {"mla_prepare", "mla_store_rows", "mla_decode", "mla_decode_skip",
                                              "mla_merge", "mla_merge_blocks", "mla_extend", *weights_first}, proc.stdout
    assert all(spill == "0" for _, spill, _ in found), proc.stdout
    waits = {name: wait for name, _, wait in found}
    assert waits.pop("mla_merge_blocks") == "1 loads / 0 stores", proc.stdout  # the row's seq len (host-written)
    assert all(waits[n] in ("0 loads / 0 stores", "no wait") for n in waits if n not in weights_first), proc.stdout
    assert all(waits[n].endswith(" loads / 0 stores") and waits[n] != "0 loads / 0 stores" for n in weights_first), \
        proc.stdout


def test_deepseek_engine_on_the_triton_backend_matches_the_torch_backend(tmp_path) -> None:
    """A tiny DeepSeek-V2-Lite-shaped checkpoint (heads 4, rank 32 + rope 16, YaRN) through the
    engine with attention_backend triton vs torch: the same greedy tokens and logprobs, on a first
    pass and on a second one that hits the prefix cache (the gathered-prefix extend path)."""
    import transformers

    from ketch.llm import LLM
    from ketch.sampling.params import SamplingParams
    from ketch.weights.source import default_model_path

    try:  # the tiny checkpoint has no tokenizer files: the bundled model's (absent on the GPU machine)
        tokenizer = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"no tokenizer for the tiny checkpoint: {e}")
    cfg = transformers.DeepseekV2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.3, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, first_k_dense_replace=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.9})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    shared = list(range(40, 60))
    prompts = [shared + [7, 8, 9], shared[:9] + [3], [11] * 30, [5]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tmp_path), tokenizer=tokenizer, dtype="float32", page_size=8,
                  kv_cache_memory=2 << 20, attention_backend=backend)
        assert isinstance(llm.engine.runner.attn, MLATritonBackend if backend == "triton" else MLAAttentionBackend)
        runs[backend] = [llm.generate(prompts, params) for _ in range(2)]
        assert [o.num_cached_tokens for o in runs[backend][1]] == [(len(p) - 1) // 8 * 8 for p in prompts]
    for ref, got in zip(runs["torch"], runs["triton"]):
        for a, b in zip(ref, got):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in b.logprobs]),
                                       torch.tensor([lp.logprob for lp in a.logprobs]), atol=1e-4, rtol=0)
