"""How a rank takes its slice of a full checkpoint tensor.

Every loader gets the whole tensor as the checkpoint stores it (HF layout, [out, in] for a
linear) and copies out the part its rank holds: a contiguous block of rows (column parallel),
of columns (row parallel), or all of it (replicated: norms, a row-parallel bias). The size of
the block comes from the destination parameter, so the shape check also catches a checkpoint
that disagrees with the config.

A 4-bit GGUF weight (q [out, in], scale and zero [out, in / 32]) is sliced the same way, each
field along the same dim in proportion to its size.
"""
from __future__ import annotations

import torch

from ketch.layers.q4 import BLOCK, Q4Weight
from ketch.parallel import SINGLE, ParallelContext


def load_shard(dst: torch.Tensor, loaded: torch.Tensor, parallel: ParallelContext, dim: int | None) -> None:
    """Copy this rank's slice of `loaded` along `dim` (None: replicated, the whole) into `dst`.
    ValueError("has shape ..., expected ...") when `loaded` is not the full tensor `dst` is a share of."""
    want = list(dst.shape)
    if dim is not None:
        want[dim] *= parallel.world_size
    if list(loaded.shape) != want:
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(want)}")
    if dim is not None and parallel.world_size > 1:
        loaded = loaded.narrow(dim, parallel.rank * dst.shape[dim], dst.shape[dim])
    dst.copy_(loaded)


def load_range(dst: torch.Tensor, loaded: torch.Tensor, dim: int, start: int, full: int) -> None:
    """Copy `loaded[start : start + len]` along `dim` into `dst`: an uneven share (whole GQA
    groups, ParallelContext.head_share) that `load_shard`'s rank * size cannot place.
    ValueError("has shape ...") when `loaded` is not the full tensor of `full` along `dim`."""
    want = list(dst.shape)
    want[dim] = full
    if list(loaded.shape) != want:
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(want)}")
    dst.copy_(loaded.narrow(dim, start, dst.shape[dim]))


def replicated_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """The loader of a parameter every rank holds whole (norm scales)."""
    load_shard(param.data, loaded, SINGLE, None)


def shard_q4(w: Q4Weight, parallel: ParallelContext, dim: int) -> Q4Weight | None:
    """This rank's slice of a 4-bit weight along `dim` (0: rows, 1: input columns); None when the
    slice would cut a block of 32 (that layer then stays dense)."""
    if parallel.world_size == 1:
        return w
    if dim == 1 and (w.q.shape[1] // parallel.world_size) % BLOCK:
        return None
    return Q4Weight(*(parallel.shard(t, dim) for t in (w.q, w.scale, w.zero)))


def narrow_q4(w: Q4Weight, dim: int, start: int, size: int) -> Q4Weight | None:
    """Rows (dim 0) or input columns (dim 1) [start, start + size) of a 4-bit weight; None when
    a column range would cut a block of 32."""
    if dim == 0:
        return Q4Weight(*(t.narrow(0, start, size) for t in (w.q, w.scale, w.zero)))
    if start % BLOCK or size % BLOCK:
        return None
    q = w.q.narrow(1, start, size)
    return Q4Weight(q, *(t.narrow(1, start // BLOCK, size // BLOCK) for t in (w.scale, w.zero)))
