"""GPU idle between engine steps, from CUDA events instead of a profiler.

A profiler slows the host and must start somewhere inside the loop, so it can show a different
picture than the run it measures. Here every launched step is bracketed on the stream by two
timing events: one recorded before the step's first operation is queued and one after its
last (the copy of the sampled ids). On the GPU's own clock:

    busy_k = start_k → end_k          (the step's queued work, back to back)
    gap_k  = end_k   → start_{k+1}    (the GPU had nothing queued: it waited for the host)

`idle = Σ gap / Σ (busy + gap)` over consecutive steps. Only `ketch bench` uses this: the
engine itself records nothing.
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


class StepTimeline:
    """Wraps `engine._launch` while active; `summary()` after the steps have finished."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __enter__(self) -> StepTimeline:
        launch = self.engine._launch

        def bracketed(chunks):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step = launch(chunks)
            end.record()
            self.marks.append((start, end))
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


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0
