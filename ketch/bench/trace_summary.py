"""Read a torch-profiler chrome trace: what the GPU ran during annotated steps, and how idle it was.

    window   = second annotated step's start → last one's end. The first step is left out: the
               profiler starts inside it, and with overlap the GPU is then still running a step
               launched before the profiler, whose kernels the trace does not have (they would
               count as idle). Without overlap each step waits for its own GPU work; with overlap
               the GPU runs one step behind the host. Kernels are clipped to the window.
    busy     = union of kernel / memcpy / memset intervals inside the window
    idle     = 1 - busy / window
    advance  = per op, in start order, how far its end moves the frontier of finished GPU work
               (end - max(start, the latest end before it), at least 0); the advances add up to
               busy. With PDL a kernel launches early and waits inside its programs, so its
               duration overlaps the kernel before it: durations add up to more than the step,
               and a small kernel launched early looks long. The advance is what the step is
               made of, per kernel (its share of the critical path of one stream).

Profiling adds host overhead per op, so `idle` is an upper bound for the unprofiled run.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_ANNOTATION = "ketch_step"

# Coarse kernel families by name, first match wins (names are library-internal; heuristic).
# ketch's own Triton kernels are named first: their names do not say "gemm" or "attention".
_FAMILIES = (
    ("attention, decode", ("_decode_split_kernel", "_decode_merge_kernel")),
    ("attention, extend/SDPA", ("_extend_kernel", "flash", "fmha", "attention", "_attn", "sdpa")),
    ("gemm/gemv", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    ("norm/rope/kv store", ("_rms_norm_kernel", "_rotary_kernel", "_store_kv_kernel")),
    ("index/gather/scatter", ("index", "gather", "scatter")),
    ("reduce/norm/softmax", ("reduce", "norm", "softmax", "argmax", "max_", "sum_")),
    ("copy/cast", ("copy", "memcpy", "memset", "cat", "convert")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise", "triton", "silu")),
)


@dataclass
class TraceSummary:
    steps: int
    window_us: float
    busy_us: float
    kernels: int  # kernels run in the window (a CUDA graph replays many with one launch)
    copies: int  # memcpy + memset operations in the window
    by_name: list[tuple[str, float, int]] = field(default_factory=list)  # (name, total µs, count), descending
    by_family: dict[str, float] = field(default_factory=dict)  # family → total µs
    advance: dict[str, float] = field(default_factory=dict)  # name → total advance µs (module docstring)

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_us / self.window_us if self.window_us > 0 else 0.0

    @property
    def kernels_per_step(self) -> float:
        return self.kernels / self.steps if self.steps else 0.0

    @property
    def step_us(self) -> float:
        return self.window_us / self.steps if self.steps else 0.0

    def format(self, top: int = 15) -> str:
        lines = [
            f"profiled steps: {self.steps}, {self.step_us / 1000:.3f} ms/step under the profiler",
            f"GPU busy {self.busy_us / self.steps / 1000:.3f} ms/step, idle {self.idle_fraction:.1%}",
            f"kernels per step: {self.kernels_per_step:.1f} (launched one by one, or replayed by a graph); "
            f"memcpy/memset per step: "
            f"{self.copies / max(1, self.steps):.1f}",
            "GPU time by kernel family (name heuristic):",
        ]
        lines += [f"  {fam:24s} {us / self.steps / 1000:8.3f} ms/step  {us / max(self.busy_us, 1e-9):6.1%}"
                  for fam, us in sorted(self.by_family.items(), key=lambda kv: -kv[1])]
        lines.append(f"top {top} kernels by GPU time (µs/step; advance: the share of the step's critical path):")
        lines += [f"  {us / self.steps:9.1f} µs/step  {n / self.steps:6.1f}/step  "
                  f"advance {self.advance.get(name, 0.0) / self.steps:8.1f} µs/step  {name[:100]}"
                  for name, us, n in self.by_name[:top]]
        return "\n".join(lines)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in _FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def summarize(trace: dict, annotation: str = STEP_ANNOTATION) -> TraceSummary:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if e.get("name") == annotation and e.get("cat") == "user_annotation"]
    if not steps:
        raise ValueError(f"trace: no {annotation!r} annotations; was the step wrapped in record_function?")
    if len(steps) < 2:
        raise ValueError("trace: one annotated step; the first is only a warm-in, profile at least 2")
    steps.sort(key=lambda e: float(e["ts"]))
    steps = steps[1:]
    lo = float(steps[0]["ts"])
    hi = max(float(e["ts"]) + float(e["dur"]) for e in steps)
    spans: list[tuple[float, float]] = []
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    per_family: dict[str, float] = defaultdict(float)
    advance: dict[str, float] = defaultdict(float)
    kernels = copies = 0
    frontier = lo
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: float(e["ts"]))
    for e in gpu:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if end <= lo or start >= hi:
            continue
        start, end = max(start, lo), min(end, hi)
        spans.append((start, end))
        advance[e["name"]] += max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)
        if e["cat"] == "kernel":
            kernels += 1
        else:
            copies += 1
        acc = per_name[e["name"]]
        acc[0] += end - start
        acc[1] += 1
        per_family[family(e["name"]) if e["cat"] == "kernel" else "copy/cast"] += end - start
    by_name = sorted(((n, v[0], int(v[1])) for n, v in per_name.items()), key=lambda t: -t[1])
    return TraceSummary(len(steps), hi - lo, _union_length(spans), kernels, copies, by_name, dict(per_family),
                        dict(advance))


def summarize_file(path: str, annotation: str = STEP_ANNOTATION) -> TraceSummary:
    with open(path, encoding="utf-8") as f:
        return summarize(json.load(f), annotation)
