"""Profile chosen windows of engine steps in a long run (a whole run's trace would be GBs).

A window `a:b` profiles the steps a .. b-1 of a round (0 = its first `Engine.step()` call) into
one chrome trace, then summarizes it (trace_summary.py: the window's first step is its warm-in,
so b - a >= 2).

Profiling stalls the run it measures: starting the profiler took ~4 s and exporting a trace ~3 s
on the H200 machine (both with the GPU idle). Each trace is exported as its window ends (a later
profiler session discards an earlier one's kernel events), so take throughput from a run
without --profile.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ketch.bench.trace_summary import TraceSummary, summarize_file


@dataclass(frozen=True)
class Window:
    start: int
    end: int  # exclusive

    @property
    def label(self) -> str:
        return f"{self.start}-{self.end}"


def parse_windows(text: str) -> list[Window]:
    """'10:14,600:606' → windows; a ValueError naming profile_windows otherwise."""
    windows = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            a, b = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"profile_windows: expected start:end[,start:end...], got {part!r}") from None
        if a < 0 or b - a < 2:
            raise ValueError(f"profile_windows: {part!r} needs 0 <= start and end - start >= 2")
        windows.append(Window(a, b))
    windows.sort(key=lambda w: w.start)
    if any(w2.start < w1.end for w1, w2 in zip(windows, windows[1:])):
        raise ValueError(f"profile_windows: windows overlap in {text!r}")
    return windows


class WindowProfiler:
    """Call `before(k)` / `after(k)` around step k; each window writes `{prefix}.{a}-{b}.json`."""

    def __init__(self, prefix: str, windows: list[Window], cuda: bool) -> None:
        self.prefix = prefix
        self.windows = windows
        self.activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        self.active: tuple[Window, torch.profiler.profile] | None = None
        self.results: list[tuple[Window, str, TraceSummary]] = []

    def before(self, step: int) -> None:
        for w in self.windows:
            if w.start == step:
                prof = torch.profiler.profile(activities=self.activities)
                prof.start()
                self.active = (w, prof)

    def after(self, step: int) -> None:
        if self.active is None or self.active[0].end - 1 != step:
            return
        w, prof = self.active
        self.active = None
        prof.stop()
        path = f"{self.prefix}.{w.label}.json"
        prof.export_chrome_trace(path)
        self.results.append((w, path, summarize_file(path)))

    def close(self) -> None:
        """A window the round ended inside: stop it without a summary."""
        if self.active is not None:
            self.active[1].stop()
            self.active = None
