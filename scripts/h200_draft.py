"""The `draft` proposer on the GPU (issue 20): a small draft model beside the target, both in CUDA
graphs, one engine, one process:

    python scripts/h200_draft.py [--model configs/llama-3.1-8b-smollm2-vocab]
        [--draft configs/smollm2-135m/config.json] [--batches 1,8,32] [--k 4]

Dummy weights of both shapes (same vocabulary). Per batch size, on random 512-token prompts,
decode-only steps timed on the host: `plain` (no drafts, overlap on) and `draft` (k drafts a
sequence every step, always verified). Each line: tok/s, ms per step, tokens per sequence and
step (1 + accepted drafts), the proposer's median ms per step (catch-up + k - 1 draft decodes; the
max is a request's first, which catches up its whole prompt),
how many of the draft's forwards replayed its CUDA graphs, and how many greedy outputs equal
plain's (in bf16 a verify's rows round differently from a plain step's and dummy weights' near
ties flip, so few do; losslessness is tests/test_spec_gpu.py's, in fp32). Random weights keep few drafts, so this measures what drafting costs and that it is
lossless in graphs; the gain a trained draft brings follows from the acceptance it reaches.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_spec import Never, decode_run  # noqa: E402  (a sibling script: the same timed decode loop)

from ketch.config import EngineConfig  # noqa: E402
from ketch.engine.engine import Engine  # noqa: E402
from ketch.spec.cost_model import AlwaysSpeculate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/llama-3.1-8b-smollm2-vocab")
    ap.add_argument("--draft", default="configs/smollm2-135m/config.json")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=96)
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=a.model, load_format="dummy", max_num_seqs=max(batches),
                                 speculative_algorithm="draft", speculative_draft_model_path=a.draft,
                                 speculative_num_draft_tokens=a.k, speculative_adaptive=False))
    spec, proposer = engine.spec, engine.spec.proposer
    draft_runner = proposer.runner
    print(f"engine up in {time.perf_counter() - t0:.0f} s; target graphs: {engine.runner.graphs is not None}; "
          f"draft graphs: {draft_runner.graphs is not None}; target pool {engine.runner.pool.num_pages} pages, "
          f"draft pool {draft_runner.pool.num_pages} pages", flush=True)
    clock: dict = {"propose_s": [], "replays": 0, "forwards": 0}
    propose, forward = proposer.propose, draft_runner.forward

    def timed_propose(batch):
        t = time.perf_counter()
        out = propose(batch)
        clock["propose_s"].append(time.perf_counter() - t)
        return out

    def counted_forward(batch):
        clock["forwards"] += 1
        clock["replays"] += draft_runner.graphs is not None and draft_runner.graphs.can_run(batch)
        return forward(batch)

    proposer.propose, draft_runner.forward = timed_propose, counted_forward
    rng = random.Random(0)
    for bs in batches:
        prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(a.prompt_len)] for _ in range(bs)]
        spec.cost, engine.overlap = Never(), True
        plain = decode_run(engine, prompts, a.gen)
        spec.cost, engine.overlap = AlwaysSpeculate(), True
        clock.update(propose_s=[], replays=0, forwards=0)
        before = spec.stats.accepted_tokens, spec.stats.verifies
        r = decode_run(engine, prompts, a.gen)
        accept = 1 + (spec.stats.accepted_tokens - before[0]) / max(1, spec.stats.verifies - before[1])
        for mode, run in (("plain", plain), ("draft", r)):
            line = dict(bs=bs, mode=mode, tok_s=round(run["tok_s"], 1), ms_step=round(run["ms_step"], 3),
                        tokens_per_seq_step=round(run["tokens_per_seq_step"], 2),
                        vs_plain=round(run["tok_s"] / plain["tok_s"], 3))
            if mode == "draft":
                line.update(accept_length=round(accept, 2), k=a.k,
                            propose_ms_median=round(1e3 * statistics.median(clock["propose_s"]), 3),
                            propose_ms_max=round(1e3 * max(clock["propose_s"]), 1),
                            draft_forwards=clock["forwards"], draft_graph_replays=clock["replays"],
                            same_as_plain=sum(x == y for x, y in zip(r["ids"], plain["ids"])), of=bs)
            print(json.dumps(line), flush=True)
    engine.check_invariants()
    print("invariants hold (target and draft pools)", flush=True)


if __name__ == "__main__":
    main()
