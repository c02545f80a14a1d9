"""Flags of `ketch bench serve` (kept apart from the driver so building the CLI parser stays cheap)."""
from __future__ import annotations

import argparse

from ketch.bench.output_path import writable_path


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers (e.g. 2048,128), got {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers (e.g. 1,3), got {text!r}") from None


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:30000 (default: from --host/--port)")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=30000)
    t.add_argument("--backend", default="openai", choices=["openai", "openai-chat"],
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    t.add_argument("--model", default=None, help="model id to send (default: the first of GET /v1/models)")
    t.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    t.add_argument("--tokenizer", default=None,
                   help="model path (GGUF or HF dir) for token counting and random prompts (default: bundled SmolLM2)")
    t.add_argument("--request-timeout", type=float, default=3600.0, help="seconds before one request is failed")
    t.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random",
                   choices=["random", "mixed", "sharegpt", "multiturn", "generated-shared-prefix"],
                   help="mixed: --num-prompts random prompts of the --mixed-input-lens in the --mixed-weights "
                        "shares; multiturn: --multiturn-clients conversations of --multiturn-rounds rounds; "
                        "generated-shared-prefix: --gsp-num-groups x --gsp-prompts-per-group prompts (neither "
                        "uses --num-prompts)")
    d.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (for --dataset-name sharegpt)")
    d.add_argument("--num-prompts", type=int, default=1000)
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=1024)
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len * ratio, len]; 1.0 fixes them")
    d.add_argument("--mixed-input-lens", type=_int_list, default=[2048, 128],
                   help="mixed: the prompt lengths, comma-separated (each prompt is exactly one of them)")
    d.add_argument("--mixed-weights", type=_float_list, default=None,
                   help="mixed: each length's share of the prompts, comma-separated (default: equal shares)")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length for ShareGPT (default: the conversation's answer length)")
    d.add_argument("--seed", type=int, default=1)
    d.add_argument("--multiturn-clients", type=int, default=8,
                   help="multiturn: conversations held at once (SGLang's bench_multiturn: --num-clients)")
    d.add_argument("--multiturn-rounds", type=int, default=4,
                   help="multiturn: rounds per conversation (--num-rounds there)")
    d.add_argument("--multiturn-turn-len", type=int, default=256,
                   help="multiturn: tokens of each new user turn (--request-length there); answers: --random-output-len")
    # SGLang bench_serving's names and defaults
    d.add_argument("--gsp-num-groups", type=int, default=64,
                   help="generated-shared-prefix: groups, each with its own system prompt")
    d.add_argument("--gsp-prompts-per-group", type=int, default=16,
                   help="generated-shared-prefix: requests per group (its system prompt + a question each)")
    d.add_argument("--gsp-system-prompt-len", type=int, default=2048,
                   help="generated-shared-prefix: tokens of each group's system prompt (random tokens)")
    d.add_argument("--gsp-question-len", type=int, default=128,
                   help="generated-shared-prefix: tokens of each request's question (random tokens)")
    d.add_argument("--gsp-output-len", type=int, default=256,
                   help="generated-shared-prefix: max_tokens of every request")

    r = p.add_argument_group("load")
    r.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once")
    r.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    r.add_argument("--warmup-requests", type=int, default=1, help="requests sent first and not counted")
    r.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache after the warmup, so the run starts with an empty prefix cache")
    r.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the server to run every request to max_tokens (default: on for random, "
                        "multiturn and generated-shared-prefix, off for sharegpt)")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--num-client-processes", type=int, default=1,
                   help="split the requests (and --max-concurrency, --request-rate) over this many client "
                        "processes, each with its own event loop; metrics are merged as one process reports them")

    o = p.add_argument_group("output")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    o.add_argument("--output-file", type=writable_path, default=None, help="write config, metrics and per-request timings as JSON")
