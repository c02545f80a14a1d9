"""`ketch bench serve`: load an OpenAI-compatible server and report bench_serving's metrics.

Works against any such server (ketch serve, llama.cpp's, vLLM, SGLang). Requests are streamed;
arrivals follow a Poisson process at --request-rate (inf: all at once), optionally capped at
--max-concurrency in flight. Warmup requests go first and are not counted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time

from tqdm import tqdm

from ketch.bench.datasets import SampleRequest, random_requests, sharegpt_requests
from ketch.bench.serve_client import RequestConfig, fetch_model, make_client, send_request
from ketch.bench.serve_metrics import RequestResult, compute_metrics, format_report, summarize_errors


def _check_args(a: argparse.Namespace) -> None:
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
    if a.dataset_name == "random":
        return random_requests(tokenizer, a.num_prompts, a.random_input_len, a.random_output_len,
                               a.random_range_ratio, a.seed)
    return sharegpt_requests(a.dataset_path, tokenizer, a.num_prompts, a.seed, a.sharegpt_output_len)


async def _limited(sem: asyncio.Semaphore | None, coro_fn):
    if sem is None:
        return await coro_fn()
    async with sem:  # the request's clock starts inside: queueing here is the client's, not the server's
        return await coro_fn()


async def _run_load(client, cfg: RequestConfig, requests: list[SampleRequest], count, a: argparse.Namespace
                    ) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
    rng = random.Random(a.seed)
    bar = tqdm(total=len(requests), disable=a.disable_tqdm, desc="requests")

    async def one(req: SampleRequest) -> RequestResult:
        r = await _limited(sem, lambda: send_request(client, cfg, req, count))
        bar.update(1)
        return r

    start = time.perf_counter()
    tasks = []
    for i, req in enumerate(requests):
        tasks.append(asyncio.create_task(one(req)))
        if math.isfinite(a.request_rate) and i + 1 < len(requests):
            await asyncio.sleep(rng.expovariate(a.request_rate))  # the arrival schedule itself
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


async def _bench(a: argparse.Namespace, base_url: str, api_key: str | None, requests: list[SampleRequest],
                 count, ignore_eos: bool) -> dict | None:
    async with make_client(a.max_concurrency, a.request_timeout) as client:
        model = a.model or await fetch_model(client, base_url, api_key)
        cfg = RequestConfig(base_url, a.backend, model, api_key, ignore_eos, a.temperature, _extra_body(a.extra_request_body))
        if a.warmup_requests:
            sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
            warm = await asyncio.gather(*(
                _limited(sem, lambda r=requests[i % len(requests)]: send_request(client, cfg, r, count))
                for i in range(a.warmup_requests)))
            if not any(w.success for w in warm):
                print(f"error: every warmup request failed: {'; '.join(summarize_errors(warm))}", file=sys.stderr)
                return None
        results, duration = await _run_load(client, cfg, requests, count, a)
    return {"model": model, "results": results, "duration": duration}


def run_bench_serve(a: argparse.Namespace) -> int:
    from ketch.text.tokenizer import Tokenizer

    _check_args(a)
    base_url = a.base_url or f"http://{a.host}:{a.port}"
    api_key = a.api_key or os.environ.get("OPENAI_API_KEY")
    _extra_body(a.extra_request_body)  # fail on a bad flag before any work
    tokenizer = Tokenizer.load(a.tokenizer)
    requests = build_requests(a, tokenizer)
    ignore_eos = a.ignore_eos if a.ignore_eos is not None else a.dataset_name == "random"

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    out = asyncio.run(_bench(a, base_url, api_key, requests, count, ignore_eos))
    if out is None:
        return 1
    results: list[RequestResult] = out["results"]
    m = compute_metrics(results, out["duration"])
    header = {
        "Backend": a.backend,
        "Traffic request rate": a.request_rate,
        "Max request concurrency": a.max_concurrency if a.max_concurrency else "not set",
    }
    print(format_report(m, header))
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
        _write_json(a, base_url, out["model"], ignore_eos, m.as_dict(), requests, results, errors)
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
             "requested_output_len": q.output_len, "ttft": r.ttft, "e2e": r.latency, "itl": r.itl,
             "error": r.error}
            for q, r in zip(requests, results)
        ],
    }
    with open(a.output_file, "w") as f:
        json.dump(doc, f, indent=2)
