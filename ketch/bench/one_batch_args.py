"""Flags of `ketch bench one-batch`, apart from the benchmark so `ketch --help` stays light (no torch)."""
from __future__ import annotations

import argparse

from ketch.bench.output_path import writable_path


def add_one_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-output-len", type=int, default=8, help="decode steps of the warm-up round (0: none)")
    p.add_argument("--profile", type=writable_path, default=None, metavar="PATH", help="write a chrome trace of decode steps here")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", type=writable_path, default=None, help="write results as JSON")
