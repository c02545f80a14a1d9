"""Plant known bugs in a copy of the repo and check that the tests named for each one catch it.

Each mutation is an exact text substitution in one source file, taken from a review that found
tests weaker than their names (issue 12): the bug once survived, so the tests named here were
strengthened until it no longer does. This script keeps it so:

    copy the working tree (tracked and untracked files git does not ignore; not .venv)
    baseline: the named tests pass on the unmutated copy        (else nothing can be concluded)
    per mutation: fresh copy, apply the substitution, run each named test on its own
                  (this venv's python, PYTHONPATH = the copy)   → every one must FAIL

Exit status: 0 when every named test fails under its mutation; 1 when one passes (the mutation
survived), errors instead of failing, or a substitution no longer applies (the code moved:
move the mutation with it); 2 when the baseline fails.

    .venv/bin/python scripts/mutation_check.py [--only NAME ...] [--list] [--no-baseline]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repo root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids; each must fail on its own


MUTATIONS = (
    Mutation(
        name="abort-leaks-a-page-reference",
        path="ketch/engine/engine.py",
        old="            if self.scheduler.finish(req, FinishReason.ABORT):\n                self._aborted.append",
        new="            self.allocator.incref(req.page_table[:1])  # planted: abort forgets a reference\n"
            "            if self.scheduler.finish(req, FinishReason.ABORT):\n                self._aborted.append",
        tests=(
            "tests/test_engine.py::test_abort_prefilling",
            "tests/test_engine.py::test_abort_decoding_and_after_finish",
            "tests/test_llm.py::test_stream_closed_early_releases_the_request",
        ),
    ),
    Mutation(
        name="stop-string-unchecked-on-the-finishing-delta",
        path="ketch/text/sample_text.py",
        old="            matched = self._check(self.detok.push([token]), emitted)\n",
        new="            matched = (emitted.append(self.stop.flush() + self.detok.push([token])) if out.finished\n"
            "                       else self._check(self.detok.push([token]), emitted))\n",
        tests=(
            "tests/test_text.py::test_stop_string_completed_by_the_finishing_delta",
            "tests/test_llm_stop.py::test_stop_string_completed_by_the_last_token_at_max_tokens",
        ),
    ),
    Mutation(
        name="repetition-penalty-ignores-the-prompt",
        path="ketch/sampling/penalties.py",
        old="            seen = (out_counts + counts[1]) > 0\n",
        new="            seen = out_counts > 0\n",
        tests=(
            "tests/test_penalty_parity.py::test_repetition_penalty_matches_hf",
            "tests/test_sampling.py::test_greedy_is_exact_argmax_and_top_k_1_is_greedy",
        ),
    ),
    # The host tier (issue 15). Loading a prefix's pages into each other's places is invisible to
    # greedy output (attention over a whole prefix does not depend on the order of its pages:
    # each key carries its own rotary phase), so only the page-content checks catch it.
    Mutation(
        name="hicache-loads-into-the-wrong-pages",
        path="ketch/cache/hiradix.py",
        old="        self.host_pool.load([h for n in run for h in n.host], pages)\n",
        new="        self.host_pool.load([h for n in run for h in n.host], pages[::-1])\n",
        tests=(
            "tests/test_hiradix.py::test_evicted_pages_go_to_the_host_and_a_hit_loads_them_back[write_back]",
            "tests/test_hiradix.py::test_random_workload_keeps_contents_and_invariants[write_back-1]",
        ),
    ),
    Mutation(
        name="hicache-write-back-skips-the-copy",
        path="ketch/cache/hiradix.py",
        old="                self._copy_to_host(leaf)  # write_back's copy",
        new="                leaf.host = self.host_pool.alloc(len(leaf.pages))  # planted: no copy",
        tests=(
            "tests/test_hicache_l2.py::test_multi_turn_output_is_identical_and_hits_the_host[write_back]",
            "tests/test_hiradix.py::test_evicted_pages_go_to_the_host_and_a_hit_loads_them_back[write_back]",
        ),
    ),
    Mutation(
        name="moe-top-k-weights-not-renormalised",
        path="ketch/layers/moe_routing.py",
        old="    if renormalize:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
        new="    if False:  # planted: norm_topk_prob ignored\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
        tests=(
            "tests/test_moe_layer.py::test_softmax_topk_is_mixtral_router",
            "tests/test_moe_models.py::test_chunked_prefill[mixtral]",
        ),
    ),
)


def applies(m: Mutation, root: Path = REPO) -> str | None:
    """None when the substitution applies to the file under `root`; else why not."""
    file = root / m.path
    if not file.is_file():
        return f"{m.path} does not exist"
    count = file.read_text().count(m.old)
    return None if count == 1 else f"the text to replace occurs {count} times in {m.path} (want 1)"


def copy_tree(dst: Path) -> None:
    """The working tree as git sees it (uncommitted edits included), without ignored paths."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():  # tracked files deleted in the working tree are listed too
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def run_tests(root: Path, tests: list[str]) -> tuple[int, str]:
    """pytest on the copy at `root`, imports resolved there before the editable install."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=root, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def summary(output: str) -> str:
    """pytest's one-line verdicts (FAILED/ERROR lines, then the counts)."""
    lines = [ln for ln in output.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    tail = [ln for ln in output.splitlines() if ln.strip()][-1:]
    return "\n".join(f"      {ln[:160]}" for ln in lines[:3] + tail)


def check_imports_from(root: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(root)}
    where = subprocess.run([sys.executable, "-c", "import ketch; print(ketch.__file__)"], env=env, cwd=root,
                           check=True, capture_output=True, text=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(root.resolve()):
        sys.exit(f"the copy's tests would import ketch from {where}, not from the copy {root}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="run this mutation (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    a = ap.parse_args()
    chosen = [m for m in MUTATIONS if not a.only or m.name in a.only]
    if a.only and len(chosen) != len(set(a.only)):
        sys.exit(f"unknown mutation in {a.only}; known: {[m.name for m in MUTATIONS]}")
    if a.list:
        for m in chosen:
            print(f"{m.name}  ({m.path})\n    " + "\n    ".join(m.tests))
        return 0

    bad = False
    for m in chosen:
        why = applies(m)
        if why:
            print(f"STALE    {m.name}: {why}")
            bad = True
    if bad:
        return 1

    work = Path(tempfile.mkdtemp(prefix="ketch-mutation-"))
    try:
        if not a.no_baseline:
            base = work / "baseline"
            copy_tree(base)
            check_imports_from(base)
            t0 = time.monotonic()
            rc, out = run_tests(base, sorted({t for m in chosen for t in m.tests}))
            print(f"baseline ({time.monotonic() - t0:.0f} s): {'pass' if rc == 0 else 'FAIL'}\n{summary(out)}")
            if rc != 0:
                print("the named tests fail without any mutation: nothing can be concluded")
                return 2
        for m in chosen:
            root = work / m.name
            copy_tree(root)
            file = root / m.path
            file.write_text(file.read_text().replace(m.old, m.new))
            print(f"mutation {m.name} ({m.path})")
            for test in m.tests:
                t0 = time.monotonic()
                rc, out = run_tests(root, [test])
                # 1: tests ran and failed. 0: all passed. Anything else (collection or usage
                # errors, an interrupted run) proves nothing about the test.
                verdict = {0: "SURVIVED", 1: "caught"}.get(rc, f"ERROR (pytest exit {rc})")
                bad |= rc != 1
                print(f"  {verdict:9} {test} ({time.monotonic() - t0:.0f} s)\n{summary(out)}")
    finally:
        if a.keep:
            print(f"copies kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("every mutation was caught" if not bad else "SOME MUTATION WAS NOT CAUGHT")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
