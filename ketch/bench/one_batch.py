"""`ketch bench one-batch`: one static batch through the engine, prefill then decode, per step.

B random prompts of `input_len` tokens are prefilled in ONE step (the token budget is raised to
B * input_len), then `output_len - 1` decode steps follow with all B requests in every step.
A step's time is the interval between the `Engine.step()` calls that return consecutive
steps' tokens, with no synchronize of its own: without overlap each call waits for its own
step, so that is the whole step (schedule, metadata, forward, sample, the copy of the ids);
with overlap (`--overlap-schedule`, the CUDA default) a call launches the next step before it
waits for the previous one, and the interval is the steady-state step as a server sees it.
A warm-up round of the same shapes runs first (kernel selection, cuBLAS handles, allocator growth).

`--profile PATH` profiles `--profile-steps` decode steps of a further round (from its middle,
so the KV length is typical) and writes a chrome trace plus a summary: kernels per step, GPU
idle fraction, top kernels (trace_summary.py).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ketch.bench.gpu_timeline import StepTimeline
from ketch.bench.trace_summary import STEP_ANNOTATION, summarize_file
from ketch.cli_args import engine_kwargs
from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams


@dataclass
class OneBatchResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_ms: float
    prefill_tok_s: float
    decode_step_ms_median: float
    decode_step_ms_p10: float
    decode_step_ms_p90: float
    decode_tok_s: float  # batch_size / median step
    decode_tok_s_per_request: float
    decode_steps_ms: list[float]  # every decode step, in order (slow outliers, drift)
    # CUDA, from timing events around each step (gpu_timeline.py), no profiler: the GPU's median
    # time per decode step, the median gap before the next, and Σ gaps / Σ (busy + gaps)
    gpu_step_busy_ms: float | None = None
    gpu_gap_ms: float | None = None
    gpu_idle_fraction: float | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(engine: Engine) -> int:
    """One `Engine.step()`; the number of tokens it returned."""
    with torch.profiler.record_function(STEP_ANNOTATION):
        outs = engine.step()
    return sum(len(o.new_token_ids) for o in outs)


def run_round(engine: Engine, batch: int, input_len: int, output_len: int, rng: random.Random, tag: str,
              profiler: torch.profiler.profile | None = None, profile_steps: int = 0) -> OneBatchResult:
    if engine.runner.device.type != "cuda":
        return _round(engine, batch, input_len, output_len, rng, tag, profiler, profile_steps)
    with StepTimeline(engine) as timeline:
        r = _round(engine, batch, input_len, output_len, rng, tag, profiler, profile_steps)
    t = timeline.summary(skip=1)  # the first launch is the prefill
    r.gpu_step_busy_ms, r.gpu_gap_ms = round(t.busy_ms, 3), round(t.gap_ms, 3)
    r.gpu_idle_fraction = round(t.idle_fraction, 4)
    return r


def _round(engine: Engine, batch: int, input_len: int, output_len: int, rng: random.Random, tag: str,
           profiler: torch.profiler.profile | None, profile_steps: int) -> OneBatchResult:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [rng.randrange(engine.vocab_size) for _ in range(input_len)], params)
    _sync(engine.runner.device)
    t0 = time.perf_counter()
    first = _step(engine)
    if first == 0 and engine.overlap:
        first = _step(engine)  # the prefill's tokens come back with the next call
    last = time.perf_counter()
    prefill_s = last - t0
    if first != batch:
        raise RuntimeError(f"one-batch: prefill took more than one step ({first} of {batch} first tokens)")
    start = max(0, (output_len - 1 - profile_steps) // 2)  # profile the middle of the decode
    steps: list[float] = []
    while engine.has_unfinished():
        if profiler is not None and len(steps) == start:
            profiler.start()
        n = _step(engine)
        now = time.perf_counter()
        if profiler is not None and len(steps) == start + profile_steps - 1:
            profiler.stop()
        if n != batch:
            raise RuntimeError(f"one-batch: a decode step served {n} of {batch} requests")
        steps.append(now - last)
        last = now
    q = statistics.quantiles(steps, n=10) if len(steps) > 1 else steps * 9
    med = statistics.median(steps)
    return OneBatchResult(
        batch_size=batch, input_len=input_len, output_len=output_len,
        prefill_ms=round(prefill_s * 1e3, 3), prefill_tok_s=round(batch * input_len / prefill_s, 1),
        decode_step_ms_median=round(med * 1e3, 3), decode_step_ms_p10=round(q[0] * 1e3, 3),
        decode_step_ms_p90=round(q[-1] * 1e3, 3),
        decode_tok_s=round(batch / med, 1),
        decode_tok_s_per_request=round(1 / med, 1),
        decode_steps_ms=[round(t * 1e3, 3) for t in steps],
    )


def _validate(a: argparse.Namespace) -> None:
    for name in ("batch_size", "input_len", "profile_steps"):
        if getattr(a, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(a, name)}")
    if a.output_len < 2:
        raise ValueError(f"output_len must be >= 2 (one prefill step, then decode steps), got {a.output_len}")
    if a.warmup_output_len < 0 or a.warmup_output_len == 1:
        raise ValueError(f"warmup_output_len must be 0 (no warm-up) or >= 2, got {a.warmup_output_len}")
    if a.profile and a.output_len < a.profile_steps + 1:
        raise ValueError(f"output_len must exceed profile_steps ({a.profile_steps}) to profile, got {a.output_len}")


def run_one_batch(a: argparse.Namespace) -> OneBatchResult:
    _validate(a)
    kw = engine_kwargs(a)
    kw["max_num_seqs"] = max(kw["max_num_seqs"], a.batch_size)
    kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"], a.batch_size * a.input_len)
    kw["chunked_prefill_size"] = None  # the whole batch is prefilled in one step
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(**kw))
    _sync(engine.runner.device)
    load_s = time.perf_counter() - t0
    rng = random.Random(a.seed)
    if a.warmup_output_len:
        run_round(engine, a.batch_size, a.input_len, a.warmup_output_len, rng, "warmup")
    r = run_round(engine, a.batch_size, a.input_len, a.output_len, rng, "run")
    print(
        f"batch {r.batch_size} | in {r.input_len} out {r.output_len} | "
        f"prefill {r.prefill_ms:.2f} ms ({r.prefill_tok_s:,.0f} tok/s) | "
        f"decode step median {r.decode_step_ms_median:.3f} ms (p10 {r.decode_step_ms_p10:.3f}, "
        f"p90 {r.decode_step_ms_p90:.3f}) | decode {r.decode_tok_s:,.1f} tok/s "
        f"({r.decode_tok_s_per_request:.1f} per request)"
    )
    if r.gpu_idle_fraction is not None:
        print(f"GPU between decode steps (CUDA events, no profiler): busy {r.gpu_step_busy_ms:.3f} ms/step, "
              f"gap {r.gpu_gap_ms:.3f} ms, idle {r.gpu_idle_fraction:.1%}")
    summary = None
    if a.profile:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if engine.runner.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=acts)
        run_round(engine, a.batch_size, a.input_len, a.output_len, rng, "profile", prof, a.profile_steps)
        prof.export_chrome_trace(a.profile)
        summary = summarize_file(a.profile)
        print(f"trace: {a.profile}\n{summary.format(top=30)}")
    engine.check_invariants()
    if a.output_file:
        meta = {
            "date": time.strftime("%Y-%m-%d"), "machine": _machine(engine.runner.device),
            "torch": torch.__version__, "dtype": str(engine.runner.dtype), "load_s": round(load_s, 2),
            "kv_pages": engine.runner.pool.num_pages, "args": vars(a) | {"func": None},
        }
        out = {"meta": meta, "result": asdict(r)}
        if summary is not None:
            out["profile"] = {"idle_fraction": summary.idle_fraction, "kernels_per_step": summary.kernels_per_step,
                              "step_ms": summary.step_us / 1e3, "by_family_us": summary.by_family,
                              "top_kernels": summary.by_name[:20]}
        with open(a.output_file, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return r


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()
