"""Weights: find a model, read its config as config.json's dict, stream its tensors under
Hugging Face names. No model family is known here: what to expect comes from above.

    read_config(path, load_format)          -> (source, dict)     config.json's keys (GGUF
                                                                  metadata translated into them)
    iter_weights(path, shapes, dtype, ...)  -> (hf_name, tensor)  one full tensor at a time

`shapes` is the model family's `weight_shapes(config)` (HF name -> full shape); a tensor whose
shape disagrees raises ValueError before the model sees it, and the dummy loader draws exactly
these. The family's config comes from `ketch.models.load_model_config`, which calls
`read_config`.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ketch.weights.source import ModelSource, default_model_path, detect_format, is_gguf_file, resolve_model_path

if TYPE_CHECKING:
    import torch

# The loaders (and torch under them) are imported by the functions that use them: the API process
# imports this package for `source` alone (where the model and its tokenizer are), and must not
# pay torch's import (~1.5 s) before it hands the engine process the tokenizer's EOS ids.

__all__ = [
    "ModelSource",
    "default_model_path",
    "detect_format",
    "iter_weights",
    "read_config",
    "resolve_model_path",
]

Shapes = Mapping[str, tuple[int, ...]]


class _WeightSource(Protocol):
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def _source(path: str | ModelSource | None, load_format: str) -> ModelSource:
    return path if isinstance(path, ModelSource) else ModelSource.resolve(path, load_format)


def read_config(path: str | ModelSource | None, load_format: str = "auto") -> tuple[str, dict[str, Any]]:
    """(where it came from, config.json's dict) of a GGUF file, an HF directory or a config.json."""
    from ketch.weights.gguf_loader import hf_config_from_gguf
    from ketch.weights.hf_loader import read_hf_config

    path = _source(path, load_format).path
    if not os.path.isdir(path) and is_gguf_file(path):
        return path, hf_config_from_gguf(path)
    return read_hf_config(path)


def iter_weights(
    path: str | ModelSource | None,
    shapes: Shapes,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int = 0,
    device: torch.device | str = "cpu",
    fp32: tuple[str, ...] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) in `dtype` on `device`, with a "Loading weights" progress bar;
    names ending in one of `fp32` in float32 instead (a router a bf16 model keeps in fp32).

    The path is checked and the file header parsed here, so bad input fails at the call, not at
    the first `next()`. `seed` only matters for dummy weights.
    """
    import torch

    from ketch.weights.dummy_loader import DummyWeights
    from ketch.weights.gguf_loader import GGUFWeights
    from ketch.weights.hf_loader import SafetensorsWeights

    model = _source(path, load_format)
    path, fmt = model.path, model.format
    source: _WeightSource
    if fmt == "gguf":
        source = GGUFWeights(path, dtype)
    elif fmt == "hf":
        source = SafetensorsWeights(path, shapes, dtype, fp32)
    else:
        source = DummyWeights(shapes, dtype, seed=seed, device=device, fp32=fp32)
    return _checked(source, shapes, torch.device(device))


def _checked(source: _WeightSource, shapes: Shapes, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from tqdm.auto import tqdm

    for name, tensor in tqdm(source, total=len(source), desc="Loading weights", unit="tensor"):
        expected = shapes.get(name)
        if expected is not None and tuple(tensor.shape) != expected:
            raise ValueError(f"model: tensor {name!r} has shape {tuple(tensor.shape)}, config implies {expected}")
        yield name, tensor.to(device)
