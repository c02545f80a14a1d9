"""`ketch bench serve`: load an OpenAI-compatible server and report bench_serving's metrics.

Works against any such server (ketch serve, llama.cpp's, vLLM, SGLang). Requests are streamed;
arrivals follow a Poisson process at --request-rate (inf: all at once), optionally capped at
--max-concurrency in flight. Warmup requests go first and are not counted; --flush-cache then
empties the server's prefix cache. The load runs on one event loop here (serve_load.py) or, with
--num-client-processes N, on N processes whose records are merged (serve_procs.py); multi-turn
conversations (--dataset-name multiturn) run on one loop (multiturn.py). Groups of prompts sharing a
system prompt (--dataset-name generated-shared-prefix) are sent shuffled, like any list of
requests. Outputs the server did not count are tokenized after the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time

from ketch.bench.datasets import (SampleRequest, mixed_requests, random_requests, random_turns,
                                  shared_prefix_requests, sharegpt_requests)
from ketch.bench.multiturn import Conversations, count_prompts, format_rounds, round_metrics, run_conversations
from ketch.bench.serve_client import RequestConfig, count_outputs, fetch_model, flush_cache, make_client
from ketch.bench.serve_engine_steps import StepWindow, read_step_clock, step_window
from ketch.bench.serve_http import HTTPClient, HTTPError
from ketch.bench.serve_load import Load, limited, new_event_loop, run_load
from ketch.bench.serve_metrics import RequestResult, compute_metrics, format_report, summarize_errors
from ketch.bench.serve_procs import run_in_processes


# a client process busier than this may be what limits the run (its event loop has no slack left)
CLIENT_BUSY_WARNING = 0.9


def _check_args(a: argparse.Namespace) -> None:
    if a.dataset_name == "multiturn":
        # a round is sent when the same client's previous answer has arrived: no schedule to split or pace
        if a.num_client_processes != 1:
            raise ValueError("num_client_processes: --dataset-name multiturn runs on one client process; use 1")
        if math.isfinite(a.request_rate):
            raise ValueError("request_rate: --dataset-name multiturn sends a client's next round when its answer "
                             "has ended; --request-rate is not supported with it (--max-concurrency caps the load)")
    if a.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {a.num_prompts}")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {a.max_concurrency}")
    if not a.request_rate > 0:
        raise ValueError(f"request_rate: must be > 0 (inf for all at once), got {a.request_rate}")
    if a.warmup_requests < 0:
        raise ValueError(f"warmup_requests: must be >= 0, got {a.warmup_requests}")
    if a.request_timeout <= 0:
        raise ValueError(f"request_timeout: must be > 0, got {a.request_timeout}")
    if a.num_client_processes < 1:
        raise ValueError(f"num_client_processes: must be >= 1, got {a.num_client_processes}")
    if a.dataset_name != "generated-shared-prefix" and a.num_client_processes > a.num_prompts:
        raise ValueError(f"num_client_processes: {a.num_client_processes} is more than --num-prompts {a.num_prompts}")
    if a.max_concurrency is not None and a.num_client_processes > a.max_concurrency:
        raise ValueError(f"num_client_processes: {a.num_client_processes} is more than --max-concurrency "
                         f"{a.max_concurrency} (each process needs a share of it)")
    if a.dataset_name == "sharegpt" and not a.dataset_path:
        raise ValueError("dataset_path: required with --dataset-name sharegpt")


def _extra_body(raw: str | None) -> tuple:
    if not raw:
        return ()
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"extra_request_body: not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("extra_request_body: must be a JSON object")
    return tuple(body.items())


def build_requests(a: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    """The requests (multiturn: only the warmup's, from another seed than the conversations' turns,
    so that the warmup caches nothing the run will use)."""
    if a.dataset_name == "multiturn":
        return random_requests(tokenizer, max(1, a.warmup_requests), a.multiturn_turn_len, a.random_output_len,
                               1.0, a.seed + 1)
    if a.dataset_name == "generated-shared-prefix":
        reqs = shared_prefix_requests(tokenizer, a.gsp_num_groups, a.gsp_prompts_per_group, a.gsp_system_prompt_len,
                                      a.gsp_question_len, a.gsp_output_len, a.seed)
        if a.num_client_processes > len(reqs):
            raise ValueError(f"num_client_processes: {a.num_client_processes} is more than the {len(reqs)} requests")
        return reqs
    if a.dataset_name == "random":
        return random_requests(tokenizer, a.num_prompts, a.random_input_len, a.random_output_len,
                               a.random_range_ratio, a.seed)
    if a.dataset_name == "mixed":
        return mixed_requests(tokenizer, a.num_prompts, a.mixed_input_lens,
                              a.mixed_weights or [1.0] * len(a.mixed_input_lens), a.random_output_len,
                              a.random_range_ratio, a.seed)
    return sharegpt_requests(a.dataset_path, tokenizer, a.num_prompts, a.seed, a.sharegpt_output_len)


def warmup_requests(a: argparse.Namespace, tokenizer, requests: list[SampleRequest]) -> list[SampleRequest]:
    """What the warmup sends: the run's own first requests, but for generated-shared-prefix random
    prompts of the question length from another seed, which share no group's system prompt (the
    run's hit rate counts only what the run itself cached, or the earlier runs without --flush-cache)."""
    if a.dataset_name != "generated-shared-prefix":
        return requests
    return random_requests(tokenizer, max(1, a.warmup_requests), a.gsp_question_len, a.gsp_output_len, 1.0, a.seed + 1)


async def _prepare(client: HTTPClient, a: argparse.Namespace, base_url: str, api_key: str | None,
                   requests: list[SampleRequest], ignore_eos: bool) -> RequestConfig | None:
    """The request config (the model asked of the server when not given), after the warmup; None
    if every warmup request failed."""
    model = a.model or await fetch_model(client, api_key)
    cfg = RequestConfig(base_url, a.backend, model, api_key, ignore_eos, a.temperature,
                        _extra_body(a.extra_request_body), a.request_timeout)
    if a.warmup_requests:
        sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        warm = await asyncio.gather(*(limited(sem, client, cfg, requests[i % len(requests)])
                                      for i in range(a.warmup_requests)))
        if not any(w.success for w in warm):
            print(f"error: every warmup request failed: {'; '.join(summarize_errors(warm))}", file=sys.stderr)
            return None
    if a.flush_cache:  # after the warmup, which would otherwise leave its prompts cached
        try:
            print(f"Flushed the server's prefix cache: {await flush_cache(client, api_key)}")
        except (ValueError, OSError, HTTPError) as e:
            print(f"error: {e}", file=sys.stderr)
            return None
    return cfg


def _bench(a: argparse.Namespace, base_url: str, api_key: str | None, requests: list[SampleRequest],
           warmup: list[SampleRequest], ignore_eos: bool, conv: Conversations | None) -> dict | None:
    load = Load(a.max_concurrency, a.request_rate, a.seed)
    show = not a.disable_tqdm
    bar = None if a.disable_tqdm else "requests"
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        client = make_client(base_url)
        try:
            cfg = runner.run(_prepare(client, a, base_url, api_key, warmup, ignore_eos))
            if cfg is None:
                return None
            clock0 = read_step_clock(base_url, api_key)  # after the warmup
            if conv is not None:
                mt = runner.run(run_conversations(client, cfg, conv, a.max_concurrency, bar))
                run, requests = mt.load, mt.sent  # what was sent: each round with its history
                results, duration, cpu = run.results, run.end - run.start, [(run.cpu_s, run.end - run.start)]
            elif a.num_client_processes == 1:
                run = runner.run(run_load(client, cfg, requests, load, bar))
                results, duration, cpu = run.results, run.end - run.start, [(run.cpu_s, run.end - run.start)]
        finally:
            runner.run(client.close())
    if a.num_client_processes > 1:
        results, duration, cpu = run_in_processes(cfg, requests, load, a.num_client_processes, show)
    steps = step_window(clock0, read_step_clock(base_url, api_key))
    return {"model": cfg.model, "results": results, "duration": duration, "client_cpu": cpu, "engine_steps": steps,
            "requests": requests}


def _client_cpu(cpu: list[tuple[float, float]], total_output: int) -> dict:
    """The client's own cost: each process's CPU share of its window, and CPU per output token
    (what bounds the client's ceiling: one core gives 1e6 / that tokens per second)."""
    return {"busy": [c / w if w > 0 else 0.0 for c, w in cpu],
            "us_per_output_token": 1e6 * sum(c for c, _ in cpu) / max(1, total_output)}


def _engine_steps(w: StepWindow | None, median_tpot_ms: float) -> dict | None:
    """The server's engine clocks over the run (ketch's /metrics) beside the client's TPOT."""
    if w is None:
        return None
    ratio = median_tpot_ms / w.mean_step_ms if w.mean_step_ms > 0 else float("nan")
    print(f"Engine steps during the run (server /metrics): {w.steps}, mean step {w.mean_step_ms:.2f} ms; "
          f"median TPOT / mean step = {ratio:.3f}")
    out = {"steps": w.steps, "mean_step_ms": w.mean_step_ms, "median_tpot_over_step": ratio,
           "decode_tpot_ms": w.decode_tpot_ms, "median_decode_tpot_ms": w.median_decode_tpot_ms,
           "median_tpot_over_median_decode_tpot": None}
    if w.decode_tpot_ms:
        print(f"Engine-side TPOT (first to last token in the engine, finished requests): mean {w.decode_tpot_ms:.2f} ms")
    if w.spec_accept_length is not None:
        out |= {"spec_accept_length": w.spec_accept_length, "spec_acceptance_rate": w.spec_acceptance_rate}
        print(f"Speculative decoding: mean acceptance length {w.spec_accept_length:.2f} tokens per verified sequence "
              f"and step; {100 * (w.spec_acceptance_rate or 0):.1f} % of draft tokens kept")
    if w.median_decode_tpot_ms:
        out["median_tpot_over_median_decode_tpot"] = median_tpot_ms / w.median_decode_tpot_ms
        print(f"Engine-side TPOT median {w.median_decode_tpot_ms:.2f} ms; "
              f"median TPOT / engine-side median TPOT = {out['median_tpot_over_median_decode_tpot']:.3f}")
    return out


def run_bench_serve(a: argparse.Namespace) -> int:
    from ketch.text.tokenizer import Tokenizer

    _check_args(a)
    base_url = a.base_url or f"http://{a.host}:{a.port}"
    api_key = a.api_key or os.environ.get("OPENAI_API_KEY")
    _extra_body(a.extra_request_body)  # fail on a bad flag before any work
    tokenizer = Tokenizer.load(a.tokenizer, field="tokenizer")
    requests = build_requests(a, tokenizer)
    conv = None
    if a.dataset_name == "multiturn":
        conv = Conversations(random_turns(tokenizer, a.multiturn_clients, a.multiturn_rounds, a.multiturn_turn_len,
                                          a.seed), a.random_output_len)
    ignore_eos = a.ignore_eos if a.ignore_eos is not None else a.dataset_name != "sharegpt"

    try:
        out = _bench(a, base_url, api_key, requests, warmup_requests(a, tokenizer, requests), ignore_eos, conv)
    except RuntimeError as e:  # a client process died: there is no whole run to report
        print(f"error: {e}", file=sys.stderr)
        return 1
    if out is None:
        return 1
    results: list[RequestResult] = out["results"]
    requests = out["requests"]

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    count_outputs(results, count_tokens)
    if conv is not None:
        count_prompts(requests, results, a.backend == "openai-chat", count_tokens)
    m = compute_metrics(results, out["duration"])
    header = {
        "Backend": a.backend,
        "Traffic request rate": a.request_rate,
        "Max request concurrency": a.max_concurrency if a.max_concurrency else "not set",
    }
    print(format_report(m, header))
    rounds = None if conv is None else round_metrics(results, conv.rounds)
    if rounds is not None:
        print(format_rounds(rounds))
    client = _client_cpu(out["client_cpu"], m.total_output)
    busy = client["busy"]
    print(f"Client CPU busy (% of the window, per process): {', '.join(f'{100 * b:.0f}' for b in busy)}; "
          f"{client['us_per_output_token']:.2f} µs of client CPU per output token")
    if max(busy) >= CLIENT_BUSY_WARNING:
        print(f"warning: a benchmark client process was busy {100 * max(busy):.0f}% of the window: these figures "
              "may be the client's ceiling rather than the server's (try --num-client-processes)")
    engine = _engine_steps(out["engine_steps"], m.median_tpot_ms)
    errors = summarize_errors(results)
    if errors:
        print("Errors (count × message):")
        for line in errors:
            print(f"  {line}")
    short = sum(1 for q, r in zip(requests, results) if r.success and r.output_len < q.output_len)
    if ignore_eos and short:
        # a server that ignores `ignore_eos` stops at EOS; its throughput is then not comparable
        print(f"warning: {short} of {m.completed} requests got fewer tokens than max_tokens "
              "(is ignore_eos honoured? a server without stream usage is counted by retokenizing)")
    if a.output_file:
        metrics = m.as_dict() | {"client": client, "engine": engine, "multiturn": rounds}
        _write_json(a, base_url, out["model"], ignore_eos, metrics, requests, results, errors)
    return 0 if m.completed else 1


def _write_json(a: argparse.Namespace, base_url: str, model: str, ignore_eos: bool, metrics: dict,
                requests: list[SampleRequest], results: list[RequestResult], errors: list[str]) -> None:
    config = {k: v for k, v in vars(a).items() if k != "func"}
    if math.isinf(config["request_rate"]):
        config["request_rate"] = "inf"  # json.dump would write Infinity, which strict JSON readers reject
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "base_url": base_url,
        "model": model,
        "ignore_eos": ignore_eos,
        "config": config,
        "metrics": metrics,
        "errors": errors,
        "requests": [
            {"success": r.success, "prompt_len": r.prompt_len, "output_len": r.output_len,
             "requested_output_len": q.output_len, "cached_tokens": r.cached_tokens, "ttft": r.ttft,
             "e2e": r.latency, "itl": r.itl, "error": r.error} | _place(a, i, q)
            for i, (q, r) in enumerate(zip(requests, results))
        ],
    }
    with open(a.output_file, "w") as f:
        json.dump(doc, f, indent=2)


def _place(a: argparse.Namespace, i: int, req: SampleRequest) -> dict:
    """Multiturn: which conversation (from 0) and round (from 1) request i was; generated-shared-prefix:
    its group (from 0)."""
    if a.dataset_name == "generated-shared-prefix":
        return {"group": req.group}
    if a.dataset_name != "multiturn":
        return {}
    return {"client": i // a.multiturn_rounds, "round": i % a.multiturn_rounds + 1}
