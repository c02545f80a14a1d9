"""Tensor parallelism: the `ParallelContext` a model is built with (rank, size, process group)."""
from ketch.parallel.context import SINGLE, HeadShare, ParallelContext

__all__ = ["SINGLE", "HeadShare", "ParallelContext"]
