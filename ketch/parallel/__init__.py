"""Tensor parallelism: the `ParallelContext` a model is built with (rank, size, process group)."""
from ketch.parallel.context import SINGLE, ParallelContext

__all__ = ["SINGLE", "ParallelContext"]
