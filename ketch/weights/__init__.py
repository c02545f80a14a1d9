"""Weights: find a model, read its config, stream its tensors under Hugging Face names.

    load_model_config(path)                 -> ModelConfig        (GGUF metadata or config.json)
    iter_weights(path, config, dtype)       -> (hf_name, tensor)  one tensor at a time
    expected_weight_names(config)           -> the names a complete checkpoint yields

Every loader yields the same names and shapes (see names.py); a tensor whose shape disagrees with
the config raises ValueError before the model sees it.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Protocol

import torch
from tqdm.auto import tqdm

from ketch.config import ModelConfig
from ketch.weights.dummy_loader import DummyWeights
from ketch.weights.gguf_loader import GGUFWeights, config_from_gguf
from ketch.weights.hf_loader import SafetensorsWeights, config_from_hf
from ketch.weights.names import expected_weight_names, weight_shapes
from ketch.weights.source import default_model_path, detect_format, is_gguf_file, resolve_model_path

__all__ = [
    "default_model_path",
    "detect_format",
    "expected_weight_names",
    "iter_weights",
    "load_model_config",
    "resolve_model_path",
    "weight_shapes",
]


class _WeightSource(Protocol):
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def load_model_config(path: str | None, load_format: str = "auto") -> ModelConfig:
    """Config from a GGUF file's metadata, an HF directory's config.json, or a config.json file."""
    path = resolve_model_path(path)
    detect_format(path, load_format)  # validates the path/format pair
    if not os.path.isdir(path) and is_gguf_file(path):
        return config_from_gguf(path)
    return config_from_hf(path)


def iter_weights(
    path: str | None,
    config: ModelConfig,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) in `dtype` on `device`, with a "Loading weights" progress bar.

    The path is checked and the file header parsed here, so bad input fails at the call, not at
    the first `next()`. `seed` only matters for dummy weights.
    """
    path = resolve_model_path(path)
    fmt = detect_format(path, load_format)
    source: _WeightSource
    if fmt == "gguf":
        source = GGUFWeights(path, config, dtype)
    elif fmt == "hf":
        source = SafetensorsWeights(path, config, dtype)
    else:
        source = DummyWeights(config, dtype, seed=seed, device=device)
    return _checked(source, weight_shapes(config), torch.device(device))


def _checked(
    source: _WeightSource, shapes: dict[str, tuple[int, ...]], device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tqdm(source, total=len(source), desc="Loading weights", unit="tensor"):
        expected = shapes.get(name)
        if expected is not None and tuple(tensor.shape) != expected:
            raise ValueError(f"model: tensor {name!r} has shape {tuple(tensor.shape)}, config implies {expected}")
        yield name, tensor.to(device)
