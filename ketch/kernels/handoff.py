"""Flag handoff: a launch waits for the one before it through a counter, not the PDL grid wait.

Under PDL (kernels/README.md) a consumer's `gdc_wait` returns once the producer grid has
*completed*: every program exited, the grid retired, its memory flushed. At batch 1 a decode layer
is a chain of ~9 launches, and that retirement sits on the critical path of each boundary. Here
the producer's programs each add 1 to a counter after their last store (a CTA barrier, then one
release add), and the consumer's programs, launched early by PDL as before, spin (acquire loads)
until the counter holds the producer's program count; then they read its output. The
acquire / release pair orders the producer's stores before the consumer's loads as the grid wait
does; everything before the producer is covered transitively (the producer itself waited for its
predecessor before it stored or signalled).

A chain's flags are a pair of slots per call site (one 128-byte line each), reused every step:

    head    a one-program launch after an ordinary gdc_wait (the routing kernel): resets slot B
            to 0, then sets slot A to 1 (release)
    middle  waits for A >= 1, ..., adds 1 to B                           (the gate|up GEMM)
    tail    waits for B >= the middle's programs; program 0 resets A to 0 (the down GEMM)

so a step starts with A = 0 whatever the last one left (the tail's reset runs after every middle
program has seen A; the next head, a whole layer later, after the tail has finished), and B is
zeroed before anyone may add to it (the head's reset is ordered before its release of A).

Off by default (KETCH_FLAG_HANDOFF=1 turns it on) until a same-run GPU A/B shows it faster
(scripts/handoff_bench.py measures the bare boundary). The interpreter runs launches one after
another, so there the waits pass at once; the flags' end states are what its tests can check.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("KETCH_FLAG_HANDOFF", "0") == "1"
SLOT_INTS = 32  # int32 words a slot: one 128-byte line, so that two slots never share one


@triton.jit
def await_flag(Flag, target):
    """Spin until *Flag >= target (one thread polls with acquire loads; the CTA waits on it)."""
    seen = tl.atomic_add(Flag, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(Flag, 0, sem="acquire", scope="gpu")


@triton.jit
def add_flag(Flag):
    """After this program's last store: every thread's stores, then one release add."""
    tl.debug_barrier()
    tl.atomic_add(Flag, 1, sem="release", scope="gpu")


@triton.jit
def head_flags(FlagA, FlagB):
    """The head's signal (one program): B reset, then A set."""
    tl.store(FlagB, 0)
    tl.debug_barrier()
    tl.atomic_xchg(FlagA, 1, sem="release", scope="gpu")


_slots: dict[tuple[int, int], torch.Tensor] = {}


def chain_flags(key: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (A, B) slots of the call site `key` (e.g. its weight's data_ptr: one pair a layer),
    zeroed at first use. The first use must come outside CUDA graph capture (the engine's eager
    warm-up steps run before any capture), so that no graph owns the buffer."""
    k = (key, device.index if device.index is not None else -1)
    flags = _slots.get(k)
    if flags is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("handoff: a chain's flags were first asked for during graph capture")
        flags = _slots[k] = torch.zeros(2 * SLOT_INTS, dtype=torch.int32, device=device)
    return flags[:1], flags[SLOT_INTS:SLOT_INTS + 1]


def reset_all() -> None:
    """Forget every chain's slots (tests)."""
    _slots.clear()

