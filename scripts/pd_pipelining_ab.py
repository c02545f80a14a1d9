"""Issue 17, pipelined transfers: the TTFT split of PD requests with long prompts prefilled in
chunks, for two checkouts side by side (e.g. before and after the prefill side sent each chunk's
pages as it finished), alternating over rounds in one session.

Per checkout and round: a prefill server (pinned to CPU 0) and a decode server (CPU 1, or the
same CPUs when there is one) of that checkout on loopback, `--chunked-prefill-size CHUNK` on both,
the TRANSFER backend, behind that checkout's `ketch gateway --pd-disaggregation`; one warm-up,
then REQUESTS completions one at a time, each a fresh prompt of LEN random token ids (no prefix
hit), max_tokens 2, greedy. Per request the decode server's `usage.pd_timing` (prefill, KV
transfer = Transferring → Success, wait at the gate, first decode) and the client's TTFT; printed
per request and as means per checkout and round.

    usage: python scripts/pd_pipelining_ab.py NAME=REPO [NAME=REPO ...]
    env:   LEN (2048) CHUNK (256) REQUESTS (6) ROUNDS (2) TRANSFER (tcp) PORT (31500) THREADS (1 per server)
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

LEN = int(os.environ.get("LEN", "2048"))
CHUNK = int(os.environ.get("CHUNK", "256"))
REQUESTS = int(os.environ.get("REQUESTS", "6"))
ROUNDS = int(os.environ.get("ROUNDS", "2"))
TRANSFER = os.environ.get("TRANSFER", "tcp")
PORT = int(os.environ.get("PORT", "31500"))
THREADS = os.environ.get("THREADS", "1")
FIELDS = ("prefill_ms", "transfer_ms", "kv_wait_ms", "first_decode_ms")


def get(url: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"content-type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if body is not None else text
    except (urllib.error.URLError, OSError) as e:
        return getattr(e, "code", 0) or 0, str(e)


def wait_up(url: str, procs: list[subprocess.Popen], deadline_s: float = 300) -> None:
    deadline = time.monotonic() + deadline_s
    while get(url + "/health", timeout=5)[0] != 200:
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise SystemExit(f"{url} did not come up")
        time.sleep(0.5)


def start(repo: str, log: str, cpus: str | None, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": repo, "UCX_TLS": os.environ.get("UCX_TLS", "tcp")}
    pin = ["taskset", "-c", cpus] if cpus else []
    return subprocess.Popen([*pin, sys.executable, "-m", "ketch.cli", *args], cwd=repo, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def run(name: str, repo: str, rnd: int, work: str, rng: random.Random) -> list[dict]:
    ncpu = os.cpu_count() or 1
    pre_cpu, dec_cpu = ("0", "1") if ncpu >= 2 else (None, None)
    boot = PORT + 9
    gw, pre_url, dec_url = f"http://127.0.0.1:{PORT}", f"http://127.0.0.1:{PORT + 1}", f"http://127.0.0.1:{PORT + 2}"
    common = ("--num-threads", THREADS, "--chunked-prefill-size", str(CHUNK),
              "--disaggregation-transfer-backend", TRANSFER, "--disaggregation-timeout", "300")
    procs = [start(repo, f"{work}/{name}-{rnd}-prefill.log", pre_cpu, "serve", "--port", str(PORT + 1),
                   "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot), *common),
             start(repo, f"{work}/{name}-{rnd}-decode.log", dec_cpu, "serve", "--port", str(PORT + 2),
                   "--disaggregation-mode", "decode", *common)]
    try:
        wait_up(pre_url, procs)
        wait_up(dec_url, procs)
        procs.append(start(repo, f"{work}/{name}-{rnd}-gateway.log", None, "gateway", "--port", str(PORT),
                           "--pd-disaggregation", "--prefill", pre_url, str(boot), "--decode", dec_url))
        wait_up(gw, procs)
        rows = []
        for i in range(REQUESTS + 1):  # the first is the warm-up
            prompt = [rng.randrange(100, 40000) for _ in range(LEN)]
            t0 = time.perf_counter()
            status, body = get(gw + "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
            e2e = time.perf_counter() - t0
            if status != 200:
                raise SystemExit(f"{name}: request {i} failed: {status} {body}")
            split = body["usage"].get("pd_timing") or {}
            if i:
                rows.append({**split, "e2e_ms": e2e * 1e3})
                print(f"  {name} round {rnd} request {i}: " + " ".join(f"{k} {v:.1f}" for k, v in rows[-1].items()),
                      flush=True)
        return rows
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> int:
    checkouts = [a.split("=", 1) for a in sys.argv[1:]]
    if not checkouts or any(len(c) != 2 for c in checkouts):
        raise SystemExit(__doc__)
    work = tempfile.mkdtemp(prefix="pd_pipelining_")
    for name, repo in checkouts:
        head = subprocess.run(["git", "-C", repo, "log", "--oneline", "-1"], capture_output=True, text=True).stdout.strip()
        print(f"# {name}: {repo} at {head}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; LEN {LEN} CHUNK {CHUNK} REQUESTS {REQUESTS} "
          f"ROUNDS {ROUNDS} TRANSFER {TRANSFER} THREADS {THREADS}; logs in {work}", flush=True)
    means: dict[str, list[dict]] = {name: [] for name, _ in checkouts}
    for rnd in range(ROUNDS):
        order = checkouts if rnd % 2 == 0 else checkouts[::-1]
        for name, repo in order:
            rows = run(name, repo, rnd, work, random.Random(1000 * rnd + 7))  # the same prompts for each
            mean = {k: statistics.mean(r[k] for r in rows if r.get(k) is not None) for k in (*FIELDS, "e2e_ms")}
            means[name].append(mean)
            print(f"{name} round {rnd} means: " + " ".join(f"{k} {v:.1f}" for k, v in mean.items()), flush=True)
    for name, rows in means.items():
        print(f"{name} over rounds: " + " ".join(f"{k} {statistics.mean(r[k] for r in rows):.1f}"
                                                  for k in (*FIELDS, "e2e_ms")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
