"""What the moved KV pages are pages *of*: both sides must agree on it byte for byte.

The KV lives per layer as a dict of named tensors, each [num_pages, page_size, *row shape]
(ketch/cache/kv_pool.py, `KVPool.layers`). A page row of one tensor is page_size x row shape
elements of one dtype; the transport copies such rows as raw bytes, so a sender and a receiver
with another dtype, page size, tensor set, row shape or layer count would exchange garbage that
looks like KV. `KVLayout` names all of that (and the model, when the engine knows its
fingerprint); the receiver sends its layout when it registers a room, every data chunk carries
the sender's digest, and a difference fails the room with the first field that differs.
"""
from __future__ import annotations

import hashlib
import math

import msgspec
import torch


class TensorRows(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str  # torch's name: "float32", "bfloat16", "float8_e4m3fn"
    row_shape: list[int]  # per token: [kv_heads, head_dim] for K/V; the page adds page_size in front
    itemsize: int

    @property
    def page_bytes_per_token(self) -> int:
        return math.prod(self.row_shape) * self.itemsize


class KVLayout(msgspec.Struct, frozen=True):
    model: str  # the model fingerprint (ketch/engine/model_fingerprint.py); "" when not known
    page_size: int
    num_layers: int
    tensors: list[TensorRows]  # in each layer's dict order: the order rows go on the wire

    @property
    def page_bytes_per_layer(self) -> int:
        """One page of every tensor of one layer."""
        return self.page_size * sum(t.page_bytes_per_token for t in self.tensors)

    @property
    def digest(self) -> str:
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]

    def difference(self, other: KVLayout, mine: str = "here", theirs: str = "at the peer") -> str | None:
        """None when the layouts match; else what differs first, for a failure reason (both
        sides read it, so the caller names the sides: "at the prefill side")."""
        for field in ("model", "page_size", "num_layers", "tensors"):
            a, b = getattr(self, field), getattr(other, field)
            if a != b:
                return f"layout mismatch: {field} is {_short(a)} {mine}, {_short(b)} {theirs}"
        return None


def layout_of(layers: list[dict[str, torch.Tensor]], model: str = "") -> KVLayout:
    """The layout of a pool's `layers`; ValueError when the layers disagree among themselves
    (the transport assumes every layer holds the same tensors)."""
    if not layers or not layers[0]:
        raise ValueError("layers: one or more layers, each a dict of one or more tensors")
    first = layers[0]
    page_size = next(iter(first.values())).shape[1]
    tensors = [TensorRows(name, str(t.dtype).removeprefix("torch."), list(t.shape[2:]), t.element_size())
               for name, t in first.items()]
    for i, layer in enumerate(layers):
        if list(layer) != list(first):
            raise ValueError(f"layers[{i}]: tensors {list(layer)}, layer 0 has {list(first)}")
        for name, t in layer.items():
            if t.dtype != first[name].dtype or t.shape[1:] != first[name].shape[1:] or t.shape[1] != page_size:
                raise ValueError(f"layers[{i}][{name!r}]: {t.dtype} {tuple(t.shape)} differs from layer 0")
            if not t.is_contiguous():
                raise ValueError(f"layers[{i}][{name!r}]: not contiguous (rows are copied as raw bytes)")
    return KVLayout(model, page_size, len(layers), tensors)


def num_pages_of(layers: list[dict[str, torch.Tensor]]) -> int:
    return next(iter(layers[0].values())).shape[0]


def check_pages(pages: list[int], num_pages: int, what: str) -> None:
    """ValueError naming `what` unless `pages` are distinct page ids of a pool of `num_pages`."""
    if not pages or any(not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < num_pages for p in pages):
        raise ValueError(f"{what}: one or more page ids in [0, {num_pages}), got {pages!r}")
    if len(set(pages)) != len(pages):
        raise ValueError(f"{what}: page ids must be distinct, got {pages!r}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
