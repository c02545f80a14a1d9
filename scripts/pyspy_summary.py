"""Summarize py-spy's raw output (`py-spy record -f raw`): the share of samples per process, and
per process the functions with the most samples, self and inclusive.

    python scripts/pyspy_summary.py spy.txt [--top 25]
"""
from __future__ import annotations

import argparse
import collections


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    by_proc: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in open(a.path):
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        # with --subprocesses the first frame names the process ("process 123:\"python3 ...\"")
        proc = frames[0] if frames[0].startswith("process ") else "main"
        by_proc[proc].append((frames[1:] if proc != "main" else frames, int(n)))
    total = sum(n for rows in by_proc.values() for _, n in rows)
    for proc, rows in sorted(by_proc.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        count = sum(n for _, n in rows)
        print(f"## {proc[:160]}: {count} samples ({100 * count / total:.1f} %)")
        own, incl = collections.Counter(), collections.Counter()
        for frames, n in rows:
            if frames:
                own[frames[-1]] += n
            for f in set(frames):
                incl[f] += n
        for title, counter in (("self", own), ("inclusive", incl)):
            print(f"  -- {title}")
            for f, n in counter.most_common(a.top):
                print(f"  {100 * n / count:5.1f} % {f[:150]}")


if __name__ == "__main__":
    main()
