"""dtype "auto" on the CPU: bf16 where bf16 matmuls are native; elsewhere fp32, except for a
4-bit GGUF model on a CPU where ketch's own 4-bit kernel runs (its products are integer
arithmetic: no emulated bf16 GEMM), which runs in bf16 too (runner/cpu_dtype.py). The emulation
variables make this machine choose as the smaller machine would."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ketch.config import EngineConfig
from ketch.cpu_bf16 import cpu_has_native_bf16
from ketch.engine.engine import Engine
from ketch import SamplingParams
from ketch.llm import LLM
from ketch.native import build
from ketch.runner.cpu_dtype import with_cpu_auto_dtype
from ketch.weights.source import ModelSource

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the engine test builds with num_threads=1

EMULATED_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
needs_vector_build = pytest.mark.skipif(
    build.isa() == "generic" or build.library_path("q4_matmul", "avx2") is None,
    reason="ketch's 4-bit kernel needs AVX2 and a C compiler")


@pytest.fixture
def machine(monkeypatch):
    """Set emulation variables, with the cached CPU answers cleared before and after."""
    def emulate(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        cpu_has_native_bf16.cache_clear()
        build.load.cache_clear()

    yield emulate
    monkeypatch.undo()
    cpu_has_native_bf16.cache_clear()
    build.load.cache_clear()


@pytest.mark.parametrize("env", [{"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"ONEDNN_MAX_CPU_ISA": "avx512_core"},
                                 {"ATEN_CPU_CAPABILITY": "avx2"}])
def test_an_emulated_smaller_machine_has_no_native_bf16(machine, env):
    machine(**env)
    assert not cpu_has_native_bf16()
    assert EngineConfig(device="cpu").torch_dtype == torch.float32


def test_an_emulation_that_keeps_bf16_keeps_it(machine):
    before = cpu_has_native_bf16()
    machine(ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    assert cpu_has_native_bf16() == before


@needs_vector_build
def test_a_4bit_gguf_runs_in_bf16_without_native_bf16(machine, smollm_path):
    machine(**EMULATED_AVX2)
    config = EngineConfig(device="cpu")
    assert with_cpu_auto_dtype(config, ModelSource.resolve(None)).torch_dtype == torch.bfloat16
    for fixed in ("float32", "bfloat16"):  # a dtype asked for is kept
        asked = dataclasses.replace(config, dtype=fixed)
        assert with_cpu_auto_dtype(asked, ModelSource.resolve(None)) is asked


@needs_vector_build
def test_not_for_dense_weights_nor_without_the_kernel(machine, tiny_config_path, monkeypatch):
    machine(**EMULATED_AVX2)
    config = EngineConfig(device="cpu")
    dense = ModelSource.resolve(tiny_config_path.removesuffix("/config.json"), "dummy")
    assert with_cpu_auto_dtype(config, dense) is config  # dense bf16 GEMMs would be emulated
    assert with_cpu_auto_dtype(dataclasses.replace(config, quantization="none"), ModelSource.resolve(None)) \
        .torch_dtype == torch.float32
    machine(KETCH_NATIVE_CPU="0")  # torch's int4 kernel then: bf16 GEMMs again
    assert with_cpu_auto_dtype(config, ModelSource.resolve(None)) is config


@needs_vector_build
def test_the_engine_takes_it(machine):
    """Built on the emulated AVX2 machine, the default engine holds its products in ketch's 4-bit
    kernel, and `LLM.config` says the dtype it runs in."""
    machine(**EMULATED_AVX2)
    llm = LLM(device="cpu", max_num_seqs=1, kv_cache_memory=16 << 20, num_threads=1)
    engine = llm.engine
    assert engine.config.torch_dtype == torch.bfloat16 and llm.config.torch_dtype == torch.bfloat16
    kernels = {type(m.int4).__name__ for m in engine.runner.model.modules() if getattr(m, "int4", None) is not None}
    assert kernels == {"NativeQ4"}


def test_without_native_bf16_the_dense_copies_are_fp32(machine, monkeypatch):
    """The steps above the crossover take the dense product; without native bf16 it runs in fp32
    (an emulated bf16 GEMM is several times slower), on bf16 rows, giving bf16 rows. The crossover
    is pinned to 0 (every step dense: timed, it moves with the machine's load, and each choice
    rounds bf16 differently) and the text is greedy (it was sampled at temperature 1: CI on
    2026-12-05 drew " TheCap." instead of " Paris")."""
    machine(**EMULATED_AVX2)
    monkeypatch.setenv("KETCH_INT4_CROSSOVER", "0")
    llm = LLM(device="cpu", max_num_seqs=1, kv_cache_memory=16 << 20, num_threads=1)
    layers = [m for m in llm.engine.runner.model.modules() if getattr(m, "int4", None) is not None]
    assert layers and all(m.weight.dtype == torch.float32 and m.activation_dtype == torch.bfloat16 for m in layers)
    m = layers[0]
    x = torch.randn(m.int4_max_tokens + 1, m.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = m(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, torch.nn.functional.linear(x.float(), m.weight).bfloat16())
    assert "Paris" in llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))[0].text


@needs_vector_build
def test_the_draft_model_takes_it_too(machine, smollm_path):
    """An fp32 target drafted by the bundled GGUF: the draft runs in bf16 on ketch's 4-bit kernel
    on the emulated AVX2 machine as it does with native bf16 (it was fp32 dense there)."""
    machine(**EMULATED_AVX2)
    engine = Engine(EngineConfig(device="cpu", dtype="float32", max_num_seqs=1, kv_cache_memory=16 << 20,
                                 num_threads=1, speculative_algorithm="draft", speculative_num_draft_tokens=2,
                                 speculative_draft_model_path=smollm_path))
    assert engine.config.torch_dtype == torch.float32  # asked for: kept
    draft = engine.spec.proposer.runner
    assert draft.dtype == torch.bfloat16
    assert {type(m.int4).__name__ for m in draft.model.modules() if getattr(m, "int4", None) is not None} == {"NativeQ4"}
