"""The model fingerprint: what names a model's K/V for the L3 tier (cache/page_format.py).

A stored page may be read by another process (a restart, another replica on the same store), so
its key and header carry a name for everything that decides its K/V: the family's config (shapes,
RoPE, norms), where the weights come from and how they are loaded (format, dtype, quantization),
and the weights' identity. Hashing whole weight files would cost seconds to minutes at start-up
for a large model, so each file is named by its name, size, and the SHA-256 of its first and last
MiB (a retrained or requantized checkpoint of the same size differs there: headers, tensor
metadata, the last tensors' values). Dummy weights are named by their seed: they are reproducible.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

from ketch.config import EngineConfig
from ketch.weights.source import ModelSource

_EDGE = 1 << 20  # bytes hashed at each end of a weight file


def model_fingerprint(source: ModelSource, model_config: Any, config: EngineConfig) -> str:
    """32 hex characters; the same for the same weights, config and load options."""
    h = hashlib.sha256()
    h.update(repr(model_config).encode())
    h.update(f"|{source.format}|{config.torch_dtype}|{config.quantization}|".encode())  # resolved: "auto" differs by machine
    if source.format == "dummy":
        h.update(b"dummy-weights-seed-0")
    else:
        for path in _weight_files(source.path):
            h.update(_file_identity(path))
    return h.hexdigest()[:32]


def _weight_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    names = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".bin", ".gguf")))
    return [os.path.join(path, n) for n in names]


def _file_identity(path: str) -> bytes:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(_EDGE)
        f.seek(max(0, size - _EDGE))
        tail = f.read(_EDGE)
    return f"{os.path.basename(path)}:{size}:".encode() + hashlib.sha256(head).digest() + hashlib.sha256(tail).digest()
