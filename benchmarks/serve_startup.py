"""How long `ketch serve` takes to answer /health, per source tree, runs interleaved:

    python benchmarks/serve_startup.py [--runs 5] [--tree /tmp/base --tree .] [--command gateway] [-- flags...]

(`--command gateway`: `ketch gateway` with no worker, up when /health answers at all: 503.)

Each run starts `python -m ketch.cli serve --port P [flags]` in one tree (its cwd and PYTHONPATH,
this interpreter), polls /health every 50 ms and stops the server; the trees take turns so a busy
moment of the machine hits both. A baseline tree: `git worktree add /tmp/base <commit>`. The
tokenizer cache is warm after the first run of each tree (its first run is reported apart)."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int, any_answer: bool) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except urllib.error.HTTPError:  # an HTTP answer that is not 200 (a gateway with no worker: 503)
        return any_answer
    except OSError:
        return False


def start_once(tree: str, command: str, flags: list[str]) -> float:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))  # and cwd: `-m` puts the cwd first on sys.path
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ketch.cli", command, "--port", str(port), *flags], env=env, cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not healthy(port, command == "gateway"):
            if proc.poll() is not None:
                raise RuntimeError(f"{tree}: the server exited with {proc.returncode}")
            if time.perf_counter() - t0 > 300:
                raise RuntimeError(f"{tree}: not healthy after 300 s")
            time.sleep(0.05)  # polling interval
        return time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tree", action="append", default=None, help="a source tree (repeat to compare)")
    ap.add_argument("--command", choices=("serve", "gateway"), default="serve")
    ap.add_argument("flags", nargs="*", help="after --: flags for the command")
    a = ap.parse_args()
    trees = a.tree or ["."]
    first = {t: start_once(t, a.command, a.flags) for t in trees}
    times: dict[str, list[float]] = {t: [] for t in trees}
    for _ in range(a.runs):
        for t in trees:
            times[t].append(start_once(t, a.command, a.flags))
    print(f"`ketch {a.command} {' '.join(a.flags)}` to an answering /health, {a.runs} runs each, interleaved")
    for t in trees:
        xs = times[t]
        print(f"{t:24s} median {statistics.median(xs):6.2f} s  min {min(xs):6.2f}  max {max(xs):6.2f}  "
              f"(first run {first[t]:.2f} s)")


if __name__ == "__main__":
    main()
