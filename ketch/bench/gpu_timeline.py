"""GPU idle between engine steps, and where a run's GPU time went, from CUDA events (no profiler).

A profiler slows the host and must start somewhere inside the loop, so it can show a different
picture than the run it measures. Here every launched step is bracketed on the stream by two
timing events: one recorded before the step's first operation is queued and one after its
last (the copy of the sampled ids). On the GPU's own clock:

    busy_k = start_k → end_k          (the step's queued work, back to back)
    gap_k  = end_k   → start_{k+1}    (the GPU had nothing queued: it waited for the host)

`idle = Σ gap / Σ (busy + gap)` over consecutive steps. Each step's shape (decode rows, new
tokens, KV tokens its decode rows attend over) is kept beside its events, so a whole run's GPU
time splits into decode-only steps and steps that carry prompt tokens (`phases`). Only `ketch
bench` uses this: the engine itself records nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TimelineSummary:
    steps: int
    busy_ms: float  # median GPU time of a step
    gap_ms: float  # median gap before the next step
    idle_fraction: float  # Σ gaps / Σ (busy + gaps)


@dataclass(frozen=True)
class StepShape:
    decode_rows: int  # chunks of one new token (decode, or a one-token prompt tail)
    new_tokens: int  # all new tokens of the step, decode rows included
    decode_kv_tokens: int  # Σ KV length over the decode rows: the tokens decode attention reads

    @property
    def decode_only(self) -> bool:
        return self.new_tokens == self.decode_rows


@dataclass
class Phase:
    """The GPU time of one kind of step over a run."""

    steps: int = 0
    busy_s: float = 0.0
    gap_s: float = 0.0  # the gaps after these steps
    new_tokens: int = 0
    decode_rows: int = 0
    decode_kv_tokens: int = 0


def shape_of(chunks: list[Any]) -> StepShape:
    decode = [c for c in chunks if c.num_new == 1]
    return StepShape(len(decode), sum(c.num_new for c in chunks),
                     sum(c.req.num_computed + 1 for c in decode))


class StepTimeline:
    """Wraps `engine._launch` while active; `summary()` / `phases()` after the steps have finished."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.shapes: list[StepShape] = []

    def __enter__(self) -> StepTimeline:
        launch = self.engine._launch

        def bracketed(chunks):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            shape = shape_of(chunks)  # before the launch moves num_computed on
            start.record()
            step = launch(chunks)
            end.record()
            self.marks.append((start, end))
            self.shapes.append(shape)
            return step

        self.engine._launch = bracketed
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine._launch  # the class's method again

    def summary(self, skip: int = 1) -> TimelineSummary:
        """Over the steps after the first `skip` (the first step of a round is a prefill)."""
        torch.cuda.synchronize()
        marks = self.marks[skip:]
        busy = [s.elapsed_time(e) for s, e in marks]
        gaps = [e.elapsed_time(s2) for (_, e), (s2, _) in zip(marks, marks[1:])]
        busy = busy[: len(gaps)]  # the last step has no next one to wait for
        total = sum(busy) + sum(gaps)
        return TimelineSummary(len(gaps), _median(busy), _median(gaps), sum(gaps) / total if total else 0.0)

    def rows(self) -> list[tuple[float, float, int, int, int]]:
        """Every recorded step: (busy ms, gap ms after it, new tokens, decode rows, decode KV tokens)."""
        torch.cuda.synchronize()
        out = []
        for k, ((start, end), shape) in enumerate(zip(self.marks, self.shapes)):
            gap = end.elapsed_time(self.marks[k + 1][0]) if k + 1 < len(self.marks) else 0.0
            out.append((round(start.elapsed_time(end), 3), round(gap, 3), shape.new_tokens, shape.decode_rows,
                        shape.decode_kv_tokens))
        return out

    def phases(self) -> dict[str, Phase]:
        """GPU time of decode-only steps and of steps with prompt tokens, over every recorded step."""
        out = {"decode": Phase(), "prefill": Phase()}
        for busy_ms, gap_ms, new_tokens, decode_rows, decode_kv_tokens in self.rows():
            p = out["decode" if new_tokens == decode_rows else "prefill"]  # StepShape.decode_only
            p.steps += 1
            p.busy_s += busy_ms / 1e3
            p.gap_s += gap_ms / 1e3
            p.new_tokens += new_tokens
            p.decode_rows += decode_rows
            p.decode_kv_tokens += decode_kv_tokens
        return out


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0
