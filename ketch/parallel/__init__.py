"""Tensor parallelism: the `ParallelContext` a model is built with (rank, size, process group)."""
from ketch.parallel.context import SINGLE, HeadShare, ParallelContext
from ketch.parallel.expert import NO_EP, ExpertParallel

__all__ = ["NO_EP", "SINGLE", "ExpertParallel", "HeadShare", "ParallelContext"]
