"""The runner's kernel choices (attention backend, layer kernels, CUDA graphs) and the Triton
backend's decode-graph buffers, checked on the CPU through Triton's interpreter.

Without CUDA, the graph runner (runner/graph_runner.py) runs its static-buffer forward eagerly
over the Triton backend's graph hooks, so the parts a graph depends on (padded sizes, padded
rows that write nothing, the page table copied into a fixed-stride buffer) are checked here
against the ordinary eager step; tests/test_gpu.py checks the captured graphs on a GPU. fp32 only: the interpreter's bf16 is not trustworthy.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest

pytest.importorskip("triton")

from conftest import greedy_ids_and_logprobs, make_tiny_engine  # noqa: E402
from ketch.config import EngineConfig  # noqa: E402
from ketch.runner.graph_runner import GraphRunner, capture_sizes  # noqa: E402

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path; tests/test_gpu.py covers CUDA")
PROMPTS = [[5, 9, 11], list(range(3, 40)), [7] * 9]  # 3 rows (padded to 4), 1 to 10 pages of 4


def test_capture_sizes_are_powers_of_two_then_the_cap():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_kernel_choices_resolve_by_device():
    cpu = EngineConfig(device="cpu")  # the CPU's layer ops: ketch's C ones (torch's for fp32, ketch/layers/ops.py)
    assert (cpu.resolved_attention_backend, cpu.resolved_layer_kernels, cpu.use_cuda_graph) == ("torch", "native", False)
    forced = EngineConfig(device="cpu", attention_backend="triton", layer_kernels="triton", cuda_graph=False)
    assert (forced.resolved_attention_backend, forced.resolved_layer_kernels, forced.use_cuda_graph) == ("triton", "triton", False)
    if torch.cuda.is_available():
        gpu = EngineConfig(device="cuda")
        assert (gpu.resolved_attention_backend, gpu.resolved_layer_kernels, gpu.use_cuda_graph) == ("triton", "triton", True)
        assert not EngineConfig(device="cuda", cuda_graph=False).use_cuda_graph


@pytest.mark.parametrize("field", ["attention_backend", "layer_kernels"])
def test_unknown_kernel_choice_is_a_value_error_naming_the_field(field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(device="cpu", **{field: "flash"})


def test_cuda_graph_required_on_the_cpu_is_a_value_error():
    with pytest.raises(ValueError, match="cuda_graph"):
        EngineConfig(device="cpu", cuda_graph=True)


def _greedy(engine, prompts=PROMPTS):
    return greedy_ids_and_logprobs(engine, prompts, max_tokens=6)


def _close(a: list[list[float]], b: list[list[float]], tol: float) -> None:
    for x, y in zip(a, b, strict=True):
        assert max(abs(u - v) for u, v in zip(x, y, strict=True)) < tol


@pytest.fixture(scope="module")
def torch_reference(tiny_config_path):
    return _greedy(make_tiny_engine(tiny_config_path, device="cpu"))


@CPU_ONLY
def test_triton_kernels_in_the_engine_match_the_torch_path(tiny_config_path, torch_reference):
    engine = make_tiny_engine(tiny_config_path, device="cpu", attention_backend="triton", layer_kernels="triton")
    assert engine.runner.attention_backend == "triton" and engine.runner.ops.name == "triton"
    ids, lps = _greedy(engine)
    assert ids == torch_reference[0]
    _close(lps, torch_reference[1], 1e-4)
    engine.check_invariants()


@CPU_ONLY
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_static_buffer_decode_equals_the_eager_triton_step(tiny_config_path, torch_reference, overlap):
    eager = make_tiny_engine(tiny_config_path, device="cpu", attention_backend="triton")
    want_ids, want_lp = _greedy(eager)
    # overlap: each decode row's input id is a placeholder, resolved inside the static forward
    padded = make_tiny_engine(tiny_config_path, device="cpu", attention_backend="triton", overlap_schedule=overlap)
    r = padded.runner
    r.graphs = GraphRunner(r.model, r.attn, max_bs=8, max_model_len=padded.max_model_len, device=r.device,
                           future=r.future)
    r.attn.graph_buffers.table.fill_(10**6)  # stale columns beyond a row's length must never be read
    sizes = []
    run = r.graphs.run
    r.graphs.run = lambda chunks: sizes.append((len(chunks), r.graphs.size_for(len(chunks)))) or run(chunks)
    got_ids, got_lp = _greedy(padded)
    assert (3, 4) in sizes  # decode steps went through the static buffers with a padded row
    assert got_ids == want_ids == torch_reference[0]
    _close(got_lp, want_lp, 1e-5)
    # padded rows (slot -1) wrote nothing: both pools hold the same K/V, page for page
    for layer in range(len(r.pool.k)):
        torch.testing.assert_close(r.pool.k[layer], eager.runner.pool.k[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.pool.v[layer], eager.runner.pool.v[layer], atol=1e-5, rtol=1e-5)
    padded.check_invariants()
