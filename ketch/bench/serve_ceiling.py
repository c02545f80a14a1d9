"""The ceiling of `ketch bench serve` itself: the CLI run against the fake server (fake_server.py)
over a grid of concurrency × client processes, one table and a raw log.

    python -m ketch.bench.serve_ceiling --concurrency 64 256 --processes 1 2 --log ceiling.txt \\
        [--fake-workers K] [--step-ms S] [--client before=/path/to/an/older/tree]

Each `--client LABEL=DIR` runs the CLI with DIR first on PYTHONPATH (an older checkout, say); every
grid point runs each client in turn on the same fake server, so a before/after pair shares the
run and the machine. A tree without `--num-client-processes` gets N > 1 as N CLIs started
together, each with 1/N of the prompts and of the concurrency; their windows are not aligned, so
that figure (marked ≈) is the sum of their tokens over the longest of their durations.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ketch.bench import fake_server

_ROWS = ("Successful requests", "Total generated tokens", "Benchmark duration (s)",
         "Output token throughput (tok/s)", "Median TPOT (ms)", "Median ITL (ms)")


def _rows(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        label, sep, value = line.partition(":")
        if sep and label.strip() in _ROWS + ("Client CPU busy (% of the window, per process)",):
            rows[label.strip()] = value.strip()
    return rows


def _has_processes_flag(tree: str | None) -> bool:
    args = Path(tree or Path(__file__).resolve().parents[2]) / "ketch" / "bench" / "serve_args.py"
    return "--num-client-processes" in args.read_text()


def _cli(tree: str | None, url: str, a: argparse.Namespace, prompts: int, conc: int, seed: int,
         extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "ketch.cli", "bench", "serve", "--base-url", url, "--num-prompts", str(prompts),
           "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
           "--random-range-ratio", "1", "--max-concurrency", str(conc), "--seed", str(seed), "--disable-tqdm"]
    if a.tokenizer:
        cmd += ["--tokenizer", a.tokenizer]
    # cwd: `python -m` puts the working directory ahead of PYTHONPATH, and it may hold another ketch
    return subprocess.Popen(cmd + extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=tree)


def _measure(tree: str | None, url: str, a: argparse.Namespace, conc: int, n: int) -> tuple[str, str]:
    """(the table's cells, the raw output)."""
    if n == 1 or _has_processes_flag(tree):
        proc = _cli(tree, url, a, a.num_prompts, conc, a.seed, ["--num-client-processes", str(n)] if n > 1 else [])
        out = proc.communicate()[0]
        r = _rows(out)
        busy = r.get("Client CPU busy (% of the window, per process)", "n/a")
        cells = (f"{r.get('Output token throughput (tok/s)', 'FAILED'):>10} {r.get('Median TPOT (ms)', '-'):>7} "
                 f"{r.get('Median ITL (ms)', '-'):>7}  {busy}")
        return cells, out
    procs = [_cli(tree, url, a, a.num_prompts // n, conc // n, a.seed + i, []) for i in range(n)]
    outs = [p.communicate()[0] for p in procs]
    rows = [_rows(o) for o in outs]
    try:
        tokens = sum(int(r["Total generated tokens"]) for r in rows)
        longest = max(float(r["Benchmark duration (s)"]) for r in rows)
        cells = f"≈{tokens / longest:>9.2f} {'-':>7} {'-':>7}  {n} separate CLIs"
    except KeyError:
        cells = "FAILED"
    return cells, "\n".join(outs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ketch.bench.serve_ceiling", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--client", action="append", default=[], metavar="LABEL=DIR",
                   help="another tree to run the client from (repeatable); the current one runs as 'current'")
    p.add_argument("--fake-workers", type=int, default=1)
    p.add_argument("--step-ms", type=float, default=0.0, help="the fake's step period (0: as fast as it can)")
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tokenizer", default=None, help="for the CLI's prompts (default: the bundled one)")
    p.add_argument("--log", default=None, help="append every CLI's whole output here")
    a = p.parse_args(argv)
    clients: list[tuple[str, str | None]] = [(c.split("=", 1)[0], c.split("=", 1)[1]) for c in a.client]
    clients.append(("current", None))

    fake = subprocess.Popen([sys.executable, fake_server.__file__, "--port", "0", "--workers", str(a.fake_workers),
                             "--step-ms", str(a.step_ms)], stdout=subprocess.PIPE, text=True)
    line = fake.stdout.readline()  # printed once every worker listens
    match = re.search(r"http://[\d.]+:\d+", line)
    if not match:
        fake.kill()
        raise SystemExit(f"the fake server did not start: {line!r}")
    url = match.group(0)
    head = (f"# fake server: {a.fake_workers} worker(s), step {a.step_ms} ms; {a.num_prompts} prompts of "
            f"{a.input_len} in / {a.output_len} out; {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(head)
    print(f"{'client':<10} {'conc':>5} {'procs':>5} {'out tok/s':>10} {'TPOT':>7} {'ITL':>7}  client CPU busy %")
    log = open(a.log, "a") if a.log else None
    try:
        if log:
            log.write(head + "\n")
        for conc in a.concurrency:
            for n in a.processes:
                for label, tree in clients:
                    cells, out = _measure(tree, url, a, conc, n)
                    print(f"{label:<10} {conc:>5} {n:>5} {cells}", flush=True)
                    if log:
                        log.write(f"\n## {label}, concurrency {conc}, {n} client process(es)\n{out}\n")
                        log.flush()
    finally:
        fake.terminate()
        fake.wait()
        if log:
            log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
