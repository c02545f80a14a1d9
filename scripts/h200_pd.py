"""Issue 17 on one GPU: a prefill and a decode `ketch serve` on the same device, each with its own
share of memory (--mem-fraction-static), behind `ketch gateway --pd-disaggregation`, against one
colocated server, on dummy weights of a real shape (seeded per tensor name: every process holds
the same weights) with the bundled SmolLM2's tokenizer. test_parity's 20 chat prompts go one at a
time (each answer is then computed in the same batch shape on both sides), greedy; the PD answers
must equal the colocated ones, text and token counts. Prints per backend the match count, the
transfers the servers counted, and the mean TTFT / end-to-end time of the PD and colocated runs.

    usage: python scripts/h200_pd.py [BACKEND ...]          (default: nixl tcp)
    env:   MODEL (configs/llama-3.1-8b-smollm2-vocab), TOKENIZER (carry/smollm2-tokenizer),
           NEW_TOKENS (32), FRACTION (0.28 per server), OUT (the log folder),
           SERVER_ARGS (more `ketch serve` flags for every server, e.g. "--chunked-prefill-size 16":
           prompts in several chunks, so the prefill side sends its KV in parts while it runs)
UCX_TLS is left as it is (unset: UCX may choose cuda_ipc / cuda_copy for GPU memory).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, "tests")
from test_parity import PROMPTS  # noqa: E402

MODEL = os.environ.get("MODEL", "configs/llama-3.1-8b-smollm2-vocab")
TOKENIZER = os.environ.get("TOKENIZER", "carry/smollm2-tokenizer")
NEW_TOKENS = int(os.environ.get("NEW_TOKENS", "32"))
FRACTION = os.environ.get("FRACTION", "0.28")
OUT = os.environ.get("OUT", "out")
SERVER_ARGS = os.environ.get("SERVER_ARGS", "").split()
ENDED = 'ketch_pd_transfers_ended_total{outcome="%s"}'


def start(name: str, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ketch.cli", *extra[:1], "--port", str(port), *extra[1:]]
    return subprocess.Popen(cmd, stdout=open(f"{OUT}/{name}.log", "w"), stderr=subprocess.STDOUT)


def serve(name: str, port: int, *extra: str) -> subprocess.Popen:
    return start(name, port, "serve", "--model", MODEL, "--load-format", "dummy", "--tokenizer", TOKENIZER,
                 "--mem-fraction-static", FRACTION, *SERVER_ARGS, *extra)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return getattr(e, "code", 0) or 0, ""


def wait_up(url: str, proc: subprocess.Popen, name: str, deadline_s: float = 300) -> None:
    deadline = time.monotonic() + deadline_s
    while get(url + "/health")[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not come up (exit {proc.poll()}); see {OUT}/{name}.log")
        time.sleep(0.5)


def ask(url: str, prompt: str) -> tuple[tuple, float, float]:
    """((text, finish reason, prompt tokens, completion tokens), TTFT s, end-to-end s), streamed."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": NEW_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, reason, usage = None, "", None, {}
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
                reason = c.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
    e2e = time.perf_counter() - t0
    return (text, reason, usage.get("prompt_tokens"), usage.get("completion_tokens")), ttft or e2e, e2e


def answers(url: str) -> tuple[list[tuple], float, float]:
    got = [ask(url, p) for p in PROMPTS]
    return [g[0] for g in got], sum(g[1] for g in got) / len(got), sum(g[2] for g in got) / len(got)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in get(url + "/metrics")[1].splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> int:
    backends = sys.argv[1:] or ["nixl", "tcp"]
    os.makedirs(OUT, exist_ok=True)
    print(f"# h200_pd: model {MODEL} (dummy), {len(PROMPTS)} prompts one at a time, {NEW_TOKENS} new tokens, greedy; "
          f"{FRACTION} of the GPU per server; server args {' '.join(SERVER_ARGS) or '(none)'}; UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}", flush=True)
    colo = serve("colocated", 30000)
    try:
        wait_up("http://127.0.0.1:30000", colo, "colocated")
        answers("http://127.0.0.1:30000")  # warm-up: first-request costs out of the timed run
        want, ttft, e2e = answers("http://127.0.0.1:30000")
        print(f"colocated: mean TTFT {ttft * 1e3:.1f} ms, mean e2e {e2e * 1e3:.1f} ms", flush=True)
    finally:
        stop(colo)
    failures = 0
    for backend in backends:
        pd = ("--disaggregation-transfer-backend", backend, "--disaggregation-timeout", "120")
        pre = serve(f"prefill-{backend}", 30001, "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", "8998", *pd)
        dec = serve(f"decode-{backend}", 30002, "--disaggregation-mode", "decode", *pd)
        gw = None
        try:
            wait_up("http://127.0.0.1:30001", pre, f"prefill-{backend}")
            wait_up("http://127.0.0.1:30002", dec, f"decode-{backend}")
            gw = start(f"gateway-{backend}", 30003, "gateway", "--pd-disaggregation", "--prefill",
                       "http://127.0.0.1:30001", "8998", "--decode", "http://127.0.0.1:30002")
            deadline = time.monotonic() + 60
            while get("http://127.0.0.1:30003/health")[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.5)
            answers("http://127.0.0.1:30003")
            got, ttft, e2e = answers("http://127.0.0.1:30003")
            same = sum(g == w for g, w in zip(got, want))
            m = [metrics(f"http://127.0.0.1:{p}") for p in (30001, 30002)]
            print(f"pd {backend}: {same}/{len(want)} answers equal colocated; transfers ended "
                  f"prefill {m[0].get(ENDED % 'succeeded')} ok / {m[0].get(ENDED % 'failed')} failed, decode "
                  f"{m[1].get(ENDED % 'succeeded')} ok / {m[1].get(ENDED % 'failed')} failed; "
                  f"mean TTFT {ttft * 1e3:.1f} ms, mean e2e {e2e * 1e3:.1f} ms", flush=True)
            for i, (g, w) in enumerate(zip(got, want)):
                if g != w:
                    print(f"  prompt {i}: pd {g!r}\n            colocated {w!r}")
            failures += same != len(want)
        except Exception as e:  # one backend failing is a line of the report, not the end of the run
            print(f"pd {backend}: FAILED {e!r}", flush=True)
            failures += 1
        finally:
            stop(*[p for p in (gw, pre, dec) if p is not None])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
