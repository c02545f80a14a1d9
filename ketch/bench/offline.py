"""`ketch bench offline`: random prompts through the in-process engine.

For each level B it submits B requests at once (random token ids, fixed input/output
lengths, ignore_eos so every request runs to length; at most --max-num-seqs run at a time,
the rest wait as a server's queue would) and reports
time to first token, decode throughput per request, and aggregate output throughput.

On CUDA every launched step is also bracketed by timing events (gpu_timeline.py), and the run's
GPU time is split into decode-only steps and steps with prompt tokens, with the KV bytes the
decode rows read: where a long run's time went without a profiler. `--profile PREFIX
--profile-windows a:b,...` adds kernel-level traces of chosen step windows of the first run of
each batch size (profile_windows.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time

import torch

from ketch.bench.gpu_timeline import Phase, StepTimeline
from ketch.bench.profile_windows import WindowProfiler, parse_windows
from ketch.bench.trace_summary import STEP_ANNOTATION
from ketch.cli_args import engine_kwargs
from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams


def measure(engine: Engine, batch: int, input_len: int, output_len: int, rng: random.Random, tag: str,
            shared_prefix: list[int] | None = None, profiler: WindowProfiler | None = None,
            sampling: tuple[float, bool] = (0.0, False)) -> dict:
    """`sampling`: (temperature, seeded); temperature 0 is greedy."""
    if engine.runner.device.type != "cuda":
        return _measure(engine, batch, input_len, output_len, rng, tag, shared_prefix, profiler, sampling)
    with StepTimeline(engine) as timeline:
        r = _measure(engine, batch, input_len, output_len, rng, tag, shared_prefix, profiler, sampling)
    r["gpu_phases"] = {k: vars(v) for k, v in timeline.phases().items()}
    r["gpu_steps"] = timeline.rows()  # for the JSON: each step's GPU time and shape
    return r


def _measure(engine: Engine, batch: int, input_len: int, output_len: int, rng: random.Random, tag: str,
             shared_prefix: list[int] | None, profiler: WindowProfiler | None, sampling: tuple[float, bool]) -> dict:
    temperature, seeded = sampling
    vocab = engine.vocab_size
    prefix = shared_prefix or []
    stats = engine.scheduler.stats
    prompt0, cached0 = stats.prompt_tokens, stats.cached_prompt_tokens
    clock0 = engine.stats()
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    sync()  # GPU: nothing of an earlier round may leak into this one's clock
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    for i in range(batch):
        params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True,
                                seed=i if seeded else None)
        engine.add_request(f"{tag}-{i}", prefix + [rng.randrange(vocab) for _ in range(input_len - len(prefix))], params)
    generated = 0
    per_step: list[tuple[float, int]] = []  # (when a step's tokens arrived, how many)
    while engine.has_unfinished():
        k = len(per_step)
        if profiler is not None:
            profiler.before(k)
        with torch.profiler.record_function(STEP_ANNOTATION):
            outs = engine.step()
        if profiler is not None:
            profiler.after(k)
        now = time.perf_counter()
        per_step.append((now, sum(len(out.new_token_ids) for out in outs)))
        generated += per_step[-1][1]
        for out in outs:
            first.setdefault(out.request_id, now)
    sync()
    total = time.perf_counter() - t0
    if profiler is not None:
        profiler.close()
    last_first = max(first.values())
    decode_time = total - (last_first - t0)
    # "decode": the tokens that arrived after every request had its first one (all rows decode)
    decoded = sum(n for t, n in per_step if t > last_first)
    decode_steps = sum(1 for t, _ in per_step if t > last_first)
    clock = engine.stats()
    rows = min(batch, engine.config.max_num_seqs)
    return {
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "total_s": round(total, 3),
        "mean_ttft_ms": round(statistics.mean(v - t0 for v in first.values()) * 1000, 1),
        "request_s": round(batch / total, 3),
        "input_tok_s": round(batch * input_len / total, 1),
        "output_tok_s": round(generated / total, 1),
        "total_tok_s": round((generated + batch * input_len) / total, 1),
        "decode_tokens": decoded,
        # the engine's own step clock (what `bench serve` reads from /metrics) and the all-decode tail
        "mean_step_ms": round(1000 * (clock.step_seconds - clock0.step_seconds) / max(1, clock.steps - clock0.steps), 3),
        "decode_step_ms": round(1000 * decode_time / decode_steps, 3) if decode_steps else None,
        "decode_tok_s": round(decoded / decode_time, 1) if decode_time > 0 else None,
        "decode_tok_s_per_request": round(decoded / decode_time / rows, 1) if decode_time > 0 else None,
        "prefix_cache_hit_rate": round((stats.cached_prompt_tokens - cached0) / max(1, stats.prompt_tokens - prompt0), 3),
        "prefill_tokens_saved": stats.cached_prompt_tokens - cached0,
        **_spec(clock0, clock),
    }


def _spec(before, after) -> dict:
    """Speculative decoding over the run: acceptance length (kept drafts + 1 per verified
    sequence and step), draft tokens proposed and kept, and how many verifies kept 0..k."""
    if not after.spec_algorithm:
        return {}
    verifies = after.spec_verifies - before.spec_verifies
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {"spec_accept_length": round(1 + accepted / verifies, 3) if verifies else None,
            "spec_proposed_tokens": after.spec_proposed_tokens - before.spec_proposed_tokens,
            "spec_accepted_tokens": accepted,
            "spec_accept_counts": [a - b for a, b in zip(after.spec_accept_counts, before.spec_accept_counts)]}


def run_offline(a: argparse.Namespace) -> list[dict]:
    sizes = list(a.batch_sizes)  # parsed by the CLI (positive_ints)
    windows = parse_windows(a.profile_windows) if a.profile else []
    if a.profile and not windows:
        raise ValueError("profile_windows: give at least one start:end window with --profile")
    if not 0 <= a.shared_prefix_len < a.input_len:  # before the model loads (minutes for a large one)
        raise ValueError(f"shared_prefix_len must be in [0, input_len), got {a.shared_prefix_len}")
    kw = engine_kwargs(a)
    # B requests are submitted at once; --max-num-seqs (default 256) caps how many run at a time
    engine = Engine(EngineConfig(**kw))
    rng = random.Random(a.seed)
    shared = [rng.randrange(engine.vocab_size) for _ in range(a.shared_prefix_len)]
    measure(engine, 1, 16, 8, rng, "warmup")  # first-call allocations and kernel selection
    gc.freeze()  # as the engine process does after start-up (process.py): no full GC passes over it
    results = []
    for b in sizes:
        # this class of machine is noisy run to run (shared cores): report the median of --repeat runs
        prof = WindowProfiler(f"{a.profile}.b{b}", windows, engine.runner.device.type == "cuda") if a.profile else None
        runs = [measure(engine, b, a.input_len, a.output_len, rng, f"b{b}r{i}", shared, prof if i == 0 else None,
                        (a.temperature, a.sampling_seed)) for i in range(a.repeat)]
        r = sorted(runs, key=lambda x: x["decode_tok_s"] or 0)[len(runs) // 2]
        r["decode_tok_s_runs"] = [x["decode_tok_s"] for x in runs]
        results.append(r)
        print(
            f"batch {b:4d} | in {a.input_len} out {a.output_len} | TTFT {r['mean_ttft_ms']:8.1f} ms | "
            f"decode {r['decode_tok_s']} tok/s ({r['decode_tok_s_per_request']} per request) | "
            f"{r['request_s']} req/s | input {r['input_tok_s']} tok/s | "
            f"output {r['output_tok_s']} tok/s | total {r['total_tok_s']} tok/s | "
            f"step {r['mean_step_ms']} ms (all-decode {r['decode_step_ms']} ms)"
            + (f" | spec accept length {r['spec_accept_length']}" if "spec_accept_length" in r else "")
            + (f" | median of {a.repeat}: {r['decode_tok_s_runs']}" if a.repeat > 1 else "")
        )
        if "gpu_phases" in r:
            print(format_phases(r["gpu_phases"], engine.runner.pool.bytes_per_token, r["total_s"]))
        for w, path, summary in prof.results if prof else []:
            print(f"profile of steps {w.label} (run 1): {path}\n{summary.format()}")
            r.setdefault("profiles", {})[w.label] = {"trace": path, "step_ms": summary.step_us / 1e3,
                                                     "idle_fraction": summary.idle_fraction,
                                                     "by_family_us_per_step": {k: v / summary.steps for k, v in summary.by_family.items()}}
        if shared:
            print(f"           prefix cache: hit rate {r['prefix_cache_hit_rate']:.1%}, "
                  f"prefill tokens saved {r['prefill_tokens_saved']}")
    engine.check_invariants()
    if a.output_file:
        dev = engine.runner.device
        machine = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine,
                "threads": torch.get_num_threads(), "dtype": str(engine.runner.dtype), "args": vars(a) | {"func": None}}
        with open(a.output_file, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2, default=str)
    return results


def format_phases(phases: dict[str, dict], kv_bytes_per_token: int, total_s: float) -> str:
    """Where the GPU time of a run went, by kind of step (CUDA events)."""
    d, p = Phase(**phases["decode"]), Phase(**phases["prefill"])
    kv_tb = d.decode_kv_tokens * kv_bytes_per_token / 1e12
    gaps = d.gap_s + p.gap_s
    lines = [
        f"GPU time by step kind (CUDA events; wall {total_s:.1f} s):",
        f"  decode-only   {d.steps:6d} steps {d.busy_s:8.2f} s busy  {d.decode_rows:,} tokens, "
        f"mean {d.decode_rows / max(1, d.steps):.0f} rows x {d.decode_kv_tokens / max(1, d.decode_rows):.0f} KV tokens; "
        f"KV read {kv_tb:.1f} TB = {kv_tb / max(d.busy_s, 1e-9):.2f} TB/s over the whole step",
        f"  with prompts  {p.steps:6d} steps {p.busy_s:8.2f} s busy  {p.new_tokens - p.decode_rows:,} prompt tokens "
        f"+ {p.decode_rows:,} decode rows",
        f"  gaps between steps {gaps:.2f} s ({gaps / max(d.busy_s + p.busy_s + gaps, 1e-9):.1%} of GPU time)",
    ]
    return "\n".join(lines)
