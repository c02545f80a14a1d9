"""`ketch serve | gateway | generate | chat | bench offline|serve`: parse arguments, call down, print."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Iterator

from ketch.bench.output_path import writable_path
from ketch.gateway.args import add_gateway_args

if TYPE_CHECKING:
    from ketch.llm import LLM


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (the error names the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"an integer >= 1, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1."""
    try:
        return [positive_int(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"comma-separated integers >= 1 (e.g. 1,32), got {text!r}") from None


# The engine's flags (ketch.cli_args) import ketch.config and with it torch (~1.3 s): they are
# imported where a command needs them, so `ketch gateway` (a proxy, no torch) starts without it.


def _generate(a: argparse.Namespace) -> int:
    from ketch.cli_args import engine_kwargs, sampling_params
    from ketch.llm import LLM

    params = sampling_params(a)  # bad flags fail before the model loads
    llm = LLM(**engine_kwargs(a))
    for delta in llm.stream(a.prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _chat(a: argparse.Namespace) -> int:
    from ketch.cli_args import engine_kwargs, sampling_params
    from ketch.llm import LLM

    params = sampling_params(a)
    llm = LLM(**engine_kwargs(a))
    messages: list[dict] = [{"role": "system", "content": a.system}] if a.system else []
    print("ketch chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        deltas = _fitting_stream(llm, messages, params, keep=1 if a.system else 0)
        if deltas is None:
            continue
        reply = ""
        for delta in deltas:
            reply += delta
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


def _fitting_stream(llm: LLM, messages: list[dict], params: Any, keep: int) -> Iterator[str] | None:
    """The reply's deltas; while the conversation does not fit the context, its oldest exchange
    after the first `keep` messages (the system prompt) is forgotten. None, and the message
    dropped, if even the new message alone does not fit (the session goes on)."""
    while True:
        try:
            return llm.stream(llm.encode_chat(messages), params)
        except ValueError as e:
            if len(messages) - keep <= 1:
                print(f"error: {e}", file=sys.stderr)
                messages.pop()
                return None
            del messages[keep:keep + 2]
            print("(the conversation outgrew the context: its oldest exchange is forgotten)", file=sys.stderr)


def _serve(a: argparse.Namespace) -> int:
    from ketch.cli_args import engine_kwargs
    from ketch.config import EngineConfig
    from ketch.server.config import ServerConfig
    from ketch.server.serve import read_chat_template, run

    server = ServerConfig(
        host=a.host, port=a.port, served_model_name=a.served_model_name, api_key=a.api_key,
        chat_template=read_chat_template(a.chat_template) if a.chat_template else None,
        max_queued_requests=a.max_queued_requests, max_request_bytes=a.max_request_bytes,
        shutdown_timeout=a.shutdown_timeout, tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser,
        max_n=a.max_n, max_request_samples=a.max_request_samples, request_timeout=a.request_timeout,
        watchdog_timeout=a.watchdog_timeout,
        max_connections=a.max_connections, header_timeout=a.header_timeout, body_timeout=a.body_timeout,
        max_header_bytes=a.max_header_bytes,
        api_server_count=a.api_server_count,
    )
    return run(EngineConfig(**engine_kwargs(a)), server)


def _gateway(a: argparse.Namespace) -> int:
    from ketch.gateway.args import gateway_config
    from ketch.gateway.serve import run

    return run(gateway_config(a))


def _bench(a: argparse.Namespace) -> int:
    from ketch.bench.offline import run_offline

    run_offline(a)
    return 0


def _bench_one_batch(a: argparse.Namespace) -> int:
    from ketch.bench.one_batch import run_one_batch

    run_one_batch(a)
    return 0


def _bench_serve(a: argparse.Namespace) -> int:
    from ketch.bench.serve import run_bench_serve

    return run_bench_serve(a)


def build_parser() -> argparse.ArgumentParser:
    from ketch.bench.one_batch_args import add_one_batch_args
    from ketch.bench.serve_args import add_bench_serve_args
    from ketch.cli_args import add_engine_args, add_sampling_args

    parser, sub = _root_parser()
    g = sub.add_parser("generate", help="complete one prompt, streaming the text")
    g.add_argument("prompt")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=_generate)

    c = sub.add_parser("chat", help="chat in the terminal with the model's chat template")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=512)
    c.set_defaults(func=_chat)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (API process + engine process)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--served-model-name", default=None, help="the model id clients send; default: the model file's name")
    s.add_argument("--chat-template", default=None, help="a Jinja chat template file that replaces the model's")
    s.add_argument("--api-key", default=os.environ.get("KETCH_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on every route but /health "
                        "(default: $KETCH_API_KEY, which keeps the key out of `ps`)")
    s.add_argument("--max-queued-requests", type=int, default=None,
                   help="sequences that may wait beyond --max-running-requests; more get a 429 (default: no limit)")
    s.add_argument("--max-request-bytes", type=int, default=32 * 1024 * 1024, help="larger bodies get a 413")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are cancelled")
    s.add_argument("--max-n", type=int, default=128, help="the largest n (samples per prompt) a request may ask for")
    s.add_argument("--max-request-samples", type=int, default=4096,
                   help="the most samples (prompts x n) one request may carry; more is a 400 before any is queued")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may run before it is aborted (408; a request's `timeout` field wins)")
    s.add_argument("--watchdog-timeout", type=float, default=300.0,
                   help="seconds the engine may go without a heartbeat, or busy without finishing a step, "
                        "before the server fails in-flight requests and exits 1")
    s.add_argument("--max-connections", type=int, default=None,
                   help="open HTTP connections at most; more are answered 503 and closed (default: no cap)")
    s.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP API processes sharing the port (SO_REUSEPORT) in front of the one engine: more "
                        "streams' tokenizing, detokenizing and SSE work in parallel (default 1)")
    s.add_argument("--header-timeout", type=float, default=30.0, help="seconds a client may take to send headers")
    s.add_argument("--max-header-bytes", type=int, default=64 * 1024,
                   help="bytes a request's line and headers may take; more get a 431 and the connection closed")
    s.add_argument("--body-timeout", type=float, default=60.0, help="seconds a client may take to send a body")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3", "mistral", "deepseek-v3"],
                   help="the model's tool-call format (templates without tool support always use hermes)")
    s.add_argument("--reasoning-parser", default=None, choices=["deepseek-r1", "qwen3"],
                   help="split <think>…</think> into reasoning_content")
    add_engine_args(s)
    s.set_defaults(func=_serve)

    _add_gateway(sub)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    off = bsub.add_parser("offline", help="throughput of the in-process engine on random prompts")
    off.add_argument("--num-prompts", type=int, default=32,
                     help="not used: each batch size B runs B prompts (kept for older command lines)")
    off.add_argument("--input-len", type=positive_int, default=128)
    off.add_argument("--output-len", type=positive_int, default=128)
    off.add_argument("--batch-sizes", type=positive_ints, default="1,32",
                     help="comma-separated concurrency levels to measure")
    off.add_argument("--shared-prefix-len", type=int, default=0,
                     help="tokens every prompt shares (a system prompt); reports the prefix cache hit rate")
    off.add_argument("--repeat", type=positive_int, default=1,
                     help="runs per batch size; the median (by decode tok/s) is reported")
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--temperature", type=float, default=0.0,
                     help="> 0: random sampling instead of greedy (what the sampler's draw costs)")
    off.add_argument("--sampling-seed", action="store_true",
                     help="with --temperature: each request carries a seed (the seeded draw)")
    off.add_argument("--output-file", type=writable_path, default=None, help="write results as JSON")
    off.add_argument("--profile", default=None, metavar="PREFIX",
                     help="write chrome traces of --profile-windows steps of each batch size's first run")
    off.add_argument("--profile-windows", default="", metavar="A:B[,A:B]",
                     help="engine steps a..b-1 of a run per trace (b - a >= 2; the first is a warm-in)")
    add_engine_args(off)
    off.set_defaults(func=_bench)
    one = bsub.add_parser("one-batch", help="one static batch: prefill latency, then per-step decode latency")
    add_one_batch_args(one)
    add_engine_args(one)
    one.set_defaults(func=_bench_one_batch)
    bs = bsub.add_parser("serve", help="load an OpenAI-compatible server and report latency/throughput metrics")
    add_bench_serve_args(bs)
    bs.set_defaults(func=_bench_serve)
    return parser


def _root_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(prog="ketch", description="ketch: fast LLM serving")
    return parser, parser.add_subparsers(dest="command", required=True)


def _add_gateway(sub: argparse._SubParsersAction) -> None:
    gw = sub.add_parser("gateway", help="an OpenAI-compatible router in front of several `ketch serve` workers")
    add_gateway_args(gw)
    gw.set_defaults(func=_gateway)


def _gateway_parser() -> argparse.ArgumentParser:
    """`ketch gateway` alone: the same subcommand, without the engine's flags (and torch)."""
    parser, sub = _root_parser()
    _add_gateway(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = (_gateway_parser() if argv[:1] == ["gateway"] else build_parser()).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ketch generate ... | head`: the reader left; end quietly, as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
