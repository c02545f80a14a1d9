"""`dtype="auto"` on a CPU without native bf16, once the model is known.

EngineConfig.torch_dtype answers from the CPU alone: bf16 where matmuls run natively in bf16
(AVX512-BF16, AMX), else fp32, since a dense bf16 GEMM without native support is emulated and
several times slower than fp32 (on AVX2 it made prefill 0.6x llama.cpp's; docs/performance.md).

A model whose products are 4-bit GGUF blocks is the exception: ketch's C kernel
(ketch/native/q4_matmul.c) computes them in integer arithmetic at every batch size, whatever the
activations' dtype, so no bf16 GEMM runs (steps above the 4-bit crossover take an fp32 dense
copy there: layers/linear.py dense_in_fp32), and bf16 halves the bytes of the KV cache and the
activations. fp32 would instead dequantize every weight to fp32 (8x the bytes of the 4-bit
blocks per decode step). So there the model runs in bf16, as on the CPUs with native bf16.
"""
from __future__ import annotations

import dataclasses

import torch
from gguf import GGMLQuantizationType

from ketch.config import EngineConfig
from ketch.layers.linear import native_int4_runs
from ketch.weights.gguf_file import GGUFFile
from ketch.weights.source import ModelSource

_FOUR_BIT = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)  # what weights/gguf_q4.py keeps 4-bit


def with_cpu_auto_dtype(config: EngineConfig, source: ModelSource) -> EngineConfig:
    """`config` with dtype bfloat16 where the module docstring's exception applies, else as given."""
    if (config.dtype != "auto" or config.torch_device.type != "cpu" or config.torch_dtype != torch.float32
            or config.quantization != "auto" or not source.is_gguf):
        return config
    if not (_mostly_four_bit(source.path) and native_int4_runs(torch.bfloat16)):
        return config
    return dataclasses.replace(config, dtype="bfloat16")


def _mostly_four_bit(path: str) -> bool:
    """Most of the file's matrix bytes are 4-bit blocks (the embedding or the head may be Q8_0/F16)."""
    try:
        matrices = [t for t in GGUFFile(path).tensors.values() if len(t.shape) == 2]
    except ValueError:  # a broken file: the model loader right after reports it, naming the model
        return False
    four_bit = sum(t.nbytes for t in matrices if t.ggml_type in _FOUR_BIT)
    return four_bit * 2 > sum(t.nbytes for t in matrices)
