"""`ketch bench serve --dataset-name multiturn`: N clients, each holding a conversation of R rounds.

Round r of a client sends the whole conversation so far (its earlier user turns and the answers
the server actually gave) plus a new user turn of `--multiturn-turn-len` random tokens, asking
for `--random-output-len` tokens; its next round starts when that answer has ended. The clients
run at once on one event loop (at most `--max-concurrency` requests in flight, if set), so each
round's prompt extends the previous one by the answer and a turn: what a prefix cache is for.

Per round it reports mean and median TTFT and the cache hit rate, cached prompt tokens over
prompt tokens, both from each answer's usage (`prompt_tokens_details.cached_tokens`); over the
rounds from the second on, the pooled mean TTFT and hit rate (the first round, after a
`--flush-cache`, is the cold one). SGLang's bench_multiturn.py calls the same knobs
--num-clients, --num-rounds, --request-length, --output-length and --max-parallel.
"""
from __future__ import annotations

import asyncio
import gc
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

from tqdm import tqdm

from ketch.bench.datasets import SampleRequest
from ketch.bench.serve_client import UNCOUNTED, RequestConfig, chat_messages, completion_prompt
from ketch.bench.serve_http import HTTPClient
from ketch.bench.serve_load import LoadRun, limited
from ketch.bench.serve_metrics import RequestResult, cache_hits, report_row, report_rule


@dataclass(frozen=True)
class Conversations:
    turns: list[list[str]]  # each client's user turns, one per round
    output_len: int  # max_tokens of every round

    @property
    def clients(self) -> int:
        return len(self.turns)

    @property
    def rounds(self) -> int:
        return len(self.turns[0])


@dataclass
class ConversationRun:
    """The run's records client-major (client c's round r at c * rounds + r), the requests as
    sent (with the histories they carried) and the window, as `run_load` reports it."""

    load: LoadRun
    sent: list[SampleRequest]


async def run_conversations(client: HTTPClient, cfg: RequestConfig, conv: Conversations,
                            max_concurrency: int | None, progress: str | None) -> ConversationRun:
    """Every client's conversation at once; `progress`: the progress bar's label (None: no bar)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=conv.clients * conv.rounds, disable=progress is None, desc=progress)

    async def converse(turns: list[str]) -> list[tuple[SampleRequest, RequestResult]]:
        history: tuple[str, ...] = ()
        done: list[tuple[SampleRequest, RequestResult]] = []
        for r, turn in enumerate(turns):
            # the prompt's length is the server's (usage); without it, counted after the run
            req = SampleRequest(turn, UNCOUNTED, conv.output_len, history)
            if done and not done[-1][1].success:  # no answer to build on: the rest is not sent
                done.append((req, RequestResult(prompt_len=UNCOUNTED, error=f"not sent: round {r} failed")))
                continue
            res = await limited(sem, client, cfg, req)
            bar.update(1)
            done.append((req, res))
            history = (*history, turn, res.generated_text)
        return done

    gc.collect()
    gc.freeze()  # as run_load: what exists now lives through the run
    cpu, start = time.process_time(), time.perf_counter()
    per_client = await asyncio.gather(*(converse(turns) for turns in conv.turns))
    end, cpu = time.perf_counter(), time.process_time() - cpu
    gc.unfreeze()
    bar.close()
    pairs = [p for conversation in per_client for p in conversation]
    return ConversationRun(LoadRun([r for _, r in pairs], start, end, cpu), [q for q, _ in pairs])


def count_prompts(sent: list[SampleRequest], results: list[RequestResult], chat: bool,
                  count_tokens: Callable[[str], int]) -> None:
    """The prompt length of every success whose server reported no usage, from the text it was
    sent (chat: the messages' contents only, without the template's tokens)."""
    for req, res in zip(sent, results, strict=True):
        if res.success and res.prompt_len == UNCOUNTED:
            text = "".join(m["content"] for m in chat_messages(req)) if chat else completion_prompt(req)
            res.prompt_len = count_tokens(text)


@dataclass(frozen=True)
class RoundMetrics:
    round: int  # from 1
    completed: int
    failed: int
    mean_ttft_ms: float
    median_ttft_ms: float
    prompt_tokens: int  # of the successes that reported cached tokens
    cached_tokens: int
    cache_hit_rate: float | None  # cached / prompt tokens; None when no answer said


def _ttft_ms(results: list[RequestResult], stat: Callable[[list[float]], float]) -> float:
    ttft = [r.ttft for r in results if r.success]
    return 1000.0 * stat(ttft) if ttft else 0.0


def round_metrics(results: list[RequestResult], rounds: int) -> dict:
    """Per round and over rounds >= 2 (pooled over their requests, not a mean of round means);
    `results` client-major as `run_conversations` gives them."""
    per_round = [results[r::rounds] for r in range(rounds)]
    out = []
    for r, rs in enumerate(per_round, start=1):
        ok = sum(1 for x in rs if x.success)
        prompt, cached, rate = cache_hits(rs)
        out.append(RoundMetrics(r, ok, len(rs) - ok, _ttft_ms(rs, statistics.fmean),
                                _ttft_ms(rs, statistics.median), prompt, cached, rate))
    later = [x for rs in per_round[1:] for x in rs]
    return {"clients": len(results) // rounds, "rounds": rounds, "per_round": [asdict(m) for m in out],
            "mean_ttft_ms_rounds_2plus": _ttft_ms(later, statistics.fmean) if later else None,
            "cache_hit_rate_rounds_2plus": cache_hits(later)[2] if later else None}


def format_rounds(m: dict) -> str:
    """The per-round block printed after the usual summary."""
    def pct(rate: float | None) -> str:
        return "n/a (the server reported no cached tokens)" if rate is None else f"{100 * rate:.2f}%"

    lines = [report_rule("Multi-turn"), report_row("Clients x rounds", f"{m['clients']} x {m['rounds']}")]
    for r in m["per_round"]:
        n = r["round"]
        lines += [report_row(f"Round {n} requests (ok / failed)", f"{r['completed']} / {r['failed']}"),
                  report_row(f"Round {n} mean TTFT (ms)", r["mean_ttft_ms"]),
                  report_row(f"Round {n} median TTFT (ms)", r["median_ttft_ms"]),
                  report_row(f"Round {n} cache hit rate", f"{pct(r['cache_hit_rate'])} "
                                                          f"({r['cached_tokens']} of {r['prompt_tokens']} tokens)")]
    if m["mean_ttft_ms_rounds_2plus"] is not None:
        lines += [report_row("Mean TTFT of rounds >= 2 (ms)", m["mean_ttft_ms_rounds_2plus"]),
                  report_row("Cache hit rate of rounds >= 2", pct(m["cache_hit_rate_rounds_2plus"]))]
    lines.append(report_rule(char="="))
    return "\n".join(lines)
