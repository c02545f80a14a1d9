"""Up to how many tokens the 4-bit kernel beats the dense GEMM: measured per weight shape at
start-up, on this machine, with the engine's threads (issue 18: no fixed threshold).

torch's int4 CPU kernel reads ~4x fewer weight bytes than the dense bf16 GEMM but computes less
efficiently, so it wins the small steps and loses the large ones; where they cross depends on the
machine. With AMX (Sapphire Rapids) the dense GEMM wins from ~8 tokens; without it (most laptops
and cloud VMs: AVX-512 or AVX2 only) the dense bf16 GEMM is several times slower and the 4-bit
kernel keeps winning at much larger batches. So each distinct (out, in) shape of a layer with
4-bit blocks is timed on the weights of all its layers (in turn, as a step streams them: one
layer's alone stays in the core's cache, and timed that way the dense GEMM won from 2-4 tokens
where the engine's step was 1.2x slower for it) at 1, 2, 4, ... tokens, both kernels alternated,
until the dense GEMM wins; the layers then take the 4-bit kernel up to the last size it won at.

A size counts as won only when the 4-bit kernel takes under MARGIN of the dense time: near a tie
either is as fast, and the margin keeps start-ups on a noisy machine from flipping the choice (and
with it the bf16 rounding) back and forth. Each kernel's time at a size is the fastest of its REPS
runs (load only ever adds time); when those runs disagree by more than NOISE the measurement was
taken under load: it is used, and kept for this process only. A clean one is kept per machine
(int4_crossover_cache.py) and later start-ups read it instead of timing. fp32 never holds 4-bit
blocks, so its numerics (and parity with HF) are untouched.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ketch.layers import int4_crossover_cache

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # token counts timed (a step's rows)
MARGIN = 0.9  # the 4-bit kernel wins a size only below this share of the dense GEMM's time
REPS = 3  # alternated timings per kernel and size; the fastest counts
NOISE = 1.5  # a kernel's slowest run over its fastest above this: measured under load, not kept
# From this many tokens a product is bound by its arithmetic, not by streaming the weight, so
# where the weight sits matters little: two layers of the shape are timed instead of all of them
# (without AMX the dense GEMM is slow there, and timing every layer took 26 s of start-up).
COMPUTE_BOUND_TOKENS = 64


def crossover(int4_s: Sequence[float], dense_s: Sequence[float], sizes: Sequence[int] = SIZES) -> int:
    """The largest size up to which the 4-bit kernel won every size timed (0: not even one token)."""
    best = 0
    for m, a, b in zip(sizes, int4_s, dense_s):
        if a >= MARGIN * b:
            break
        best = m
    return best


def _seconds(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@dataclass(frozen=True)
class Measured:
    tokens: int  # the crossover
    noisy: bool  # some kernel's runs at some size disagreed by more than NOISE


def noisy(runs: Sequence[float]) -> bool:
    return max(runs) > NOISE * min(runs)


@torch.inference_mode()
def measure(int4_mms: Sequence[Callable[[torch.Tensor], torch.Tensor]],
            dense_mms: Sequence[Callable[[torch.Tensor], torch.Tensor]], in_features: int, dtype: torch.dtype,
            sizes: Sequence[int] = SIZES, reps: int = REPS) -> Measured:
    """Time both products of every layer of one shape, one after the other as a step runs them (so
    their weights stream from memory as in a step: one layer's alone would sit in the core's cache
    and favour the dense GEMM), at each size until the dense one wins; the crossover."""
    g = torch.Generator().manual_seed(0)
    int4_s: list[float] = []
    dense_s: list[float] = []
    under_load = False

    def run_all(mms: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> None:
        for mm in mms:
            mm(x)

    for m in sizes:
        x = torch.randn(m, in_features, generator=g).to(dtype)
        some = slice(None) if m < COMPUTE_BOUND_TOKENS else slice(2)
        int4_m, dense_m = int4_mms[some], dense_mms[some]
        run_all(int4_m, x), run_all(dense_m, x)  # warm: first calls allocate (and oneDNN picks its kernel)
        a, b = [], []
        for _ in range(reps):  # alternated, so a burst of load hits both alike
            a.append(_seconds(lambda: run_all(int4_m, x)))
            b.append(_seconds(lambda: run_all(dense_m, x)))
        int4_s.append(min(a))
        dense_s.append(min(b))
        under_load |= noisy(a) or noisy(b)
        if int4_s[-1] >= MARGIN * dense_s[-1]:
            break  # the dense GEMM won: larger steps only favour it more
    return Measured(crossover(int4_s, dense_s, sizes), under_load)


def calibrate(layers: Iterable[torch.nn.Module]) -> tuple[dict[tuple[int, int], int], str]:
    """Set `int4_max_tokens` on every layer holding 4-bit blocks, once per (out, in) shape over all
    the layers of that shape: read from this machine's cache, else measured (and kept if clean).
    Returns the crossover per shape and where it came from ("cached", "measured earlier in this
    process", "measured", or "measured under load, kept for this process only")."""
    by_shape: dict[tuple[int, int], list[torch.nn.Module]] = {}
    for layer in layers:
        if getattr(layer, "int4", None) is not None:
            by_shape.setdefault(tuple(layer.weight.shape), []).append(layer)
    if not by_shape:
        return {}, "no 4-bit layers"
    first = next(iter(by_shape.values()))[0]
    # the activations' dtype (the dense weight may be kept in fp32: linear.dense_in_fp32)
    dtype = getattr(first, "activation_dtype", None) or first.weight.dtype
    kernel = first.int4.kernel_id + ("" if first.weight.dtype == dtype else f"|dense {first.weight.dtype}")
    found, source = _known(list(by_shape), dtype, kernel)
    if found is None:
        found, under_load = {}, False
        for shape, group in by_shape.items():
            r = measure([m.int4_product for m in group], [m.dense_product for m in group], shape[1], dtype)
            found[shape], under_load = r.tokens, under_load or r.noisy
        source = "measured under load, kept for this process only" if under_load else "measured"
        _MEASURED_HERE[_key(list(by_shape), dtype, kernel)] = dict(found)
        if not under_load:
            int4_crossover_cache.store(found, dtype, kernel)
    for shape, group in by_shape.items():
        for m in group:
            m.int4_max_tokens = steps_up_to(found[shape])
    return found, source


# This process's measurements, those under load too: every engine one process builds (a test's
# eager and compiled pair, a speculative draft beside its target) takes the same kernels, so the
# same bf16 rounding, however loaded the machine was as each started (CI, 2026-12-04: two engines,
# 8 and 16 tokens for one shape, different greedy text).
_MEASURED_HERE: dict[str, dict[tuple[int, int], int]] = {}


def _key(shapes: list[tuple[int, int]], dtype: torch.dtype, kernel: str) -> str:
    return str(int4_crossover_cache.cache_path(shapes, dtype, kernel))


def _known(shapes: list[tuple[int, int]], dtype: torch.dtype, kernel: str) -> tuple[dict | None, str]:
    """A pinned crossover (KETCH_INT4_CROSSOVER=<tokens>), else an earlier measurement: this
    process's, else the machine's cache (none when asked to measure)."""
    setting = os.environ.get("KETCH_INT4_CROSSOVER", "")
    if setting == "measure":
        return None, ""
    if setting:
        return {shape: pinned_tokens(setting) for shape in shapes}, f"pinned by KETCH_INT4_CROSSOVER={setting}"
    here = _MEASURED_HERE.get(_key(shapes, dtype, kernel))
    if here is not None:
        return dict(here), "measured earlier in this process"
    return int4_crossover_cache.load(shapes, dtype, kernel), "cached"


def pinned_tokens(setting: str) -> int:
    """KETCH_INT4_CROSSOVER=<tokens>: every shape takes the 4-bit kernel for steps of up to that
    many tokens, no timing. A machine whose timings are never clean (a loaded or small VM) times
    at every start and may choose differently each time, and the two products round bf16
    differently: the pin makes every start choose alike (reproducible greedy text)."""
    if not setting.isdigit():
        raise ValueError(f"KETCH_INT4_CROSSOVER: 'measure' or a token count, got {setting!r}")
    return int(setting)


def steps_up_to(tokens: int) -> int:
    """The largest step a layer takes the 4-bit kernel for, from its crossover: a dense GEMM that
    lost at every size timed (AVX2: ketch's 4-bit kernel won 256 tokens by ~1.5x; prefill chunks
    of thousands of tokens through a bf16 GEMM without native bf16 made TTFT twice llama.cpp's) is
    not taken for larger steps either: both costs grow with the tokens from there."""
    return UNBOUNDED if tokens >= SIZES[-1] else tokens


UNBOUNDED = 1 << 62
