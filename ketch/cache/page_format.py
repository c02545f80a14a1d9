"""What a stored KV page is a page *of*: the model, the element types, the page size, the layout of
its tensors and the TP rank whose share of the heads it holds.

A page in L3 outlives the process that wrote it and may be read by another engine (a restart,
another replica on the same store, another model sharing a Redis). `PageFormat` names everything
that must agree before its bytes can be used; the codec writes it into every page's header and
refuses a page whose header differs (ketch/cache/page_codec.py), and `key` folds it into the
storage key so that pages of different formats do not even collide.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass

import torch

from ketch.cache.kv_pool import KVPool

_MAX_FINGERPRINT = 128


def dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'bfloat16', 'float8_e4m3fn': torch's own attribute name."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str, field: str = "dtype") -> torch.dtype:
    """The torch dtype called `name`; ValueError naming `field` when there is none."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{field}: {name!r} is not a torch dtype")
    return dtype


@dataclass(frozen=True)
class TensorLayout:
    """One tensor of the page in every layer: its name, per-token shape and element type as stored."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not self.name or any(not isinstance(n, int) or n < 1 for n in self.shape) or not self.shape:
            raise ValueError(f"tensors: {self.name!r} needs a name and a per-token shape of positive ints, "
                             f"got {self.shape}")
        dtype_of(self.dtype, f"tensors: {self.name!r} dtype")

    def bytes_per_token(self) -> int:
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize


@dataclass(frozen=True)
class PageFormat:
    fingerprint: str  # names the model: weights, config, anything that changes its K/V
    kv_dtype: str  # the pool's "kv" element type (dtype_name)
    page_size: int
    num_layers: int
    tensors: tuple[TensorLayout, ...]  # in the spec's order; the payload follows it
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.fingerprint or len(self.fingerprint) > _MAX_FINGERPRINT or not self.fingerprint.isprintable():
            raise ValueError(f"fingerprint: 1-{_MAX_FINGERPRINT} printable characters, got {self.fingerprint!r}")
        dtype_of(self.kv_dtype, "kv_dtype")
        for name in ("page_size", "num_layers", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")
        if not self.tensors or not all(isinstance(t, TensorLayout) for t in self.tensors):
            raise ValueError(f"tensors: a page holds one or more TensorLayouts, got {self.tensors!r}")

    @classmethod
    def for_pool(cls, pool: KVPool, fingerprint: str, tp_rank: int = 0, tp_size: int = 1) -> PageFormat:
        """The format of `pool`'s pages (a HostPool mirrors its device pool's: the same format)."""
        tensors = tuple(TensorLayout(t.name, tuple(t.shape), dtype_name(t.torch_dtype(pool.dtype, pool.compute_dtype)))
                        for t in pool.spec.tensors)
        return cls(fingerprint, dtype_name(pool.dtype), pool.page_size, pool.spec.num_layers, tensors,
                   tp_rank, tp_size)

    @property
    def payload_bytes(self) -> int:
        """One page of every tensor of every layer."""
        return self.num_layers * self.page_size * sum(t.bytes_per_token() for t in self.tensors)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, fields: dict[str, object]) -> PageFormat:
        """The inverse of to_json (ValueError on anything malformed: the caller reports "header")."""
        tensors = tuple(TensorLayout(str(t["name"]), tuple(int(n) for n in t["shape"]), str(t["dtype"]))
                        for t in fields["tensors"])
        return cls(**{**fields, "tensors": tensors})

    def key(self, page_hash: bytes) -> str:
        """The storage key of the page whose chained hash (ketch/cache/page_hash.py) is `page_hash`:
        the hash, then a digest of this whole format, so a page of another model, dtype, page size,
        layout or rank has another key. The hash comes first: the file backend shards on it."""
        if not isinstance(page_hash, bytes) or not page_hash:
            raise ValueError(f"page_hash: a page's chained hash (non-empty bytes), got {page_hash!r}")
        return f"{page_hash.hex()}-{self.digest}"

    @property
    def digest(self) -> str:
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).hexdigest()[:32]
