"""Speculative decoding on the GPU (issue 20), one engine, one process:

    python scripts/h200_spec.py [--model configs/llama-3.1-8b] [--batches 1,8,64] [--ks 1,2,4,8]

Per batch size, on random 512-token prompts, decode-only steps timed on the host (prefill excluded):
  plain         no speculation, overlap on (the CUDA default)
  plain-sync    no speculation, overlap off (what a verify step's host gap costs)
  oracle k      the target's own greedy continuation (recorded by `plain`) as the draft: every
                draft kept, the upper bound of the verify machinery at k; greedy ids == plain's
  turn-off      (--turnoff-batches) an oracle whose first m of k = 4 tokens are right (acceptance
                length m + 1 on demand): always vs adaptive vs plain per (bs, m): where the cost
                model stops speculating and whether it tracks the better of the two
  ngram         prompt lookup on repetitive prompts (a motif repeated), k = 4, always / adaptive
                (the cost model; `plain steps` says how often it chose not to speculate)
  block         (--algorithm block --block-batches ..., k = max of --ks) the block draft head's pass
                every step with the oracle's tokens as its drafts, sure of each: all wrong (its
                whole cost, always / adaptive) and all right (the machinery's upper bound); hidden
                states copied out of the decode graphs. The plain run keeps no hidden states. (The
                head's own random guesses are not used: on dummy weights the target's greedy chain
                is degenerate enough that a random head guesses it.)
Each line: tok/s, ms per step, tokens per sequence and step, vs plain in the same run."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams
from ketch.spec.cost_model import AlwaysSpeculate, SpecCostModel
from ketch.spec.ngram import NgramProposer
from ketch.spec.oracle import OracleProposer


class Never(AlwaysSpeculate):
    """The cost model of a plain run: no drafts, steps overlap as usual."""

    def should_speculate(self, batch_size: int) -> bool:
        return False


def decode_run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    ids: dict[str, list[int]] = {}
    steps, tokens = [], []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        started = len(ids) == len(prompts)
        for o in outs:
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
        if started and outs and all(len(v) < max_tokens for v in ids.values()):
            steps.append(dt)  # a full decode step: every request still running
            tokens.append(sum(len(o.new_token_ids) for o in outs))
    total_s = sum(steps)
    return dict(ids=[ids[f"r{i}"] for i in range(len(prompts))], tok_s=sum(tokens) / total_s if total_s else 0.0,
                ms_step=statistics.median(steps) * 1e3 if steps else 0.0,
                tokens_per_seq_step=sum(tokens) / len(steps) / len(prompts) if steps else 0.0, steps=len(steps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default=None, help="default 1,8,64 (none with --algorithm block)")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--ngram-batches", default=None, help="default 1,8,32,64,128 (none with --algorithm block)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=256)
    ap.add_argument("--oracle-fixpoint", type=int, default=12, help="most re-recorded oracle runs per k")
    ap.add_argument("--turnoff-batches", default="", help="e.g. 1,8,32,64: the acceptance sweep")
    ap.add_argument("--turnoff-gen", type=int, default=320, help="tokens per request in the sweep (blocks to learn from)")
    ap.add_argument("--algorithm", choices=("ngram", "block"), default="ngram",
                    help="block: the engine runs the block head (only --block-batches is meaningful)")
    ap.add_argument("--block-batches", default="", help="e.g. 1,8,32: block vs plain (needs --algorithm block)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    block_only = a.algorithm == "block"  # the oracle / ngram sections swap the proposer: not on a block engine
    if block_only and (a.batches or a.ngram_batches or a.turnoff_batches):
        ap.error("--algorithm block runs --block-batches only")
    a.batches = "" if block_only else a.batches if a.batches is not None else "1,8,64"
    a.ngram_batches = "" if block_only else a.ngram_batches if a.ngram_batches is not None else "1,8,32,64,128"
    batches = [int(x) for x in a.batches.split(",")] if a.batches else []
    ks = [int(x) for x in a.ks.split(",")]
    nb = [int(x) for x in a.ngram_batches.split(",")] if a.ngram_batches else []
    tb = [int(x) for x in a.turnoff_batches.split(",")] if a.turnoff_batches else []
    bb = [int(x) for x in a.block_batches.split(",")] if a.block_batches else []
    if bb and a.algorithm != "block":
        ap.error("--block-batches needs --algorithm block")
    max_bs = max(batches + nb + tb + bb)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=a.model, load_format=a.load_format, device=a.device, dtype=a.dtype,
                                 max_num_seqs=max_bs, speculative_algorithm=a.algorithm, cuda_graph_max_bs=a.cuda_graph_max_bs,
                                 speculative_num_draft_tokens=max(ks + [4]), speculative_adaptive=False))
    print(f"engine up in {time.perf_counter() - t0:.0f} s; graphs: {engine.runner.graphs is not None}", flush=True)
    vocab = engine.vocab_size
    rng = random.Random(0)
    spec = engine.spec
    results = []

    def report(bs: int, mode: str, r: dict, base: dict | None, same: bool | None = None) -> None:
        ratio = r["tok_s"] / base["tok_s"] if base else 1.0
        line = dict(bs=bs, mode=mode, tok_s=round(r["tok_s"], 1), ms_step=round(r["ms_step"], 3),
                    tokens_per_seq_step=round(r["tokens_per_seq_step"], 2), vs_plain=round(ratio, 3), steps=r["steps"],
                    same_as_plain=same, plain_steps=r.get("plain_steps"))
        results.append(line)
        print(json.dumps(line), flush=True)

    def mode(cost, proposer=None, overlap=True) -> None:
        spec.cost = cost
        if proposer is not None:
            spec.proposer = proposer
        engine.overlap = overlap

    def accept_length(run) -> float:
        before = spec.stats.accepted_tokens, spec.stats.verifies
        r = run()
        return r, 1 + (spec.stats.accepted_tokens - before[0]) / max(1, spec.stats.verifies - before[1])

    def turnoff(bs: int) -> None:
        """Plain, then the oracle's fixed point at k = 4 (every step's shape is k + 1 rows a
        sequence, whatever m), then per m: always and adaptive with m right tokens a draft."""
        prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(bs)]
        mode(Never())
        plain = decode_run(engine, prompts, a.turnoff_gen)
        report(bs, "plain (turn-off sweep)", plain, None)
        want = plain["ids"]
        for _ in range(a.oracle_fixpoint):
            mode(AlwaysSpeculate(), OracleProposer(4, {tuple(p): ids for p, ids in zip(prompts, want)}))
            r = decode_run(engine, prompts, a.turnoff_gen)
            if r["ids"] == want:
                break
            want = r["ids"]
        runs = {tuple(p): ids for p, ids in zip(prompts, want)}
        for m in range(5):
            for name, cost in (("always", AlwaysSpeculate()), ("adaptive", SpecCostModel())):
                mode(cost, OracleProposer(4, runs, correct=m, vocab_size=vocab))
                r, acc = accept_length(lambda: decode_run(engine, prompts, a.turnoff_gen))
                r["plain_steps"] = cost.plain_steps
                report(bs, f"turn-off m={m} {name} (accept length {acc:.2f}, fixed point {r['ids'] == want})",
                       r, plain, r["ids"] == plain["ids"])

    def block(bs: int) -> None:
        """Plain (no hidden states kept), then through the head: the oracle's fixed point, every
        draft wrong and every draft right, always and adaptive."""
        head, runner = spec.proposer, engine.runner
        prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(bs)]
        decode_run(engine, prompts[:1], 8)  # warm-up
        runner.keep_hidden = False
        mode(Never())
        plain = decode_run(engine, prompts, a.gen)
        report(bs, "plain (block engine, no hidden states kept)", plain, None)
        runner.keep_hidden = True
        want, tries, r = plain["ids"], 0, None
        for tries in range(1, a.oracle_fixpoint + 1):  # (see the oracle k lines below)
            head.oracle, head.cost = OracleProposer(head.k, {tuple(p): ids for p, ids in zip(prompts, want)}), None
            mode(AlwaysSpeculate())
            r = decode_run(engine, prompts, a.gen)
            if r["ids"] == want:
                break
            want = r["ids"]
        runs = {tuple(p): ids for p, ids in zip(prompts, want)}
        # every draft wrong (m = 0): the head's pass and the verify for nothing, the most block can
        # lose, and whether the cost model and schedule turn it off; then every draft right
        for m, what in ((0, "all drafts wrong"), (head.k, f"oracle, fixed point after {tries} runs")):
            for name, cost, table in (("always", AlwaysSpeculate(), None), ("adaptive", SpecCostModel(), spec.verify_cost)):
                head.oracle, head.cost = OracleProposer(head.k, runs, correct=m, vocab_size=vocab), table
                mode(cost)
                r, acc = accept_length(lambda: decode_run(engine, prompts, a.gen))
                r["plain_steps"] = cost.plain_steps
                report(bs, f"block k={head.k} {what}, {name} (accept length {acc:.2f})", r, plain, r["ids"] == plain["ids"])

    for bs in bb:
        block(bs)
    for bs in batches:
        prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(bs)]
        decode_run(engine, prompts[:1], 8)  # warm-up (graphs of the small sizes, caches)
        mode(Never())
        plain = decode_run(engine, prompts, a.gen)
        report(bs, "plain", plain, None)
        mode(Never(), overlap=False)
        report(bs, "plain-sync", decode_run(engine, prompts, a.gen), plain)
        for k in ks:
            # bf16 on random weights: the greedy chain flips at near-ties when the GEMM shapes
            # change (1 row vs k + 1), so the plain run's continuation is not what a verify
            # computes. The oracle's continuation is re-recorded from its own run until a run
            # reproduces it (every draft kept, so every step has the same shape): a fixed point.
            want, r, tries = plain["ids"], None, 0
            for tries in range(1, a.oracle_fixpoint + 1):
                mode(AlwaysSpeculate(), OracleProposer(k, {tuple(p): ids for p, ids in zip(prompts, want)}))
                r = decode_run(engine, prompts, a.gen)
                if r["ids"] == want:
                    break
                want = r["ids"]
            report(bs, f"oracle k={k} (fixed point after {tries} runs: {r['ids'] == want})", r, plain,
                   r["ids"] == plain["ids"])
    for bs in tb:
        turnoff(bs)
    for bs in nb:  # repetitive prompts: a motif of 4-8 tokens repeated, random tokens between
        prompts = []
        for _ in range(bs):
            motif = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 9))]
            prompts.append((motif * (a.prompt_len // len(motif)))[: a.prompt_len])
        mode(Never())
        plain = decode_run(engine, prompts, a.gen)
        report(bs, "plain (repetitive)", plain, None)
        for name, cost in (("ngram k=4 always", AlwaysSpeculate()), ("ngram k=4 adaptive", SpecCostModel())):
            mode(cost, NgramProposer(4))
            before = spec.stats.accepted_tokens, spec.stats.verifies
            r = decode_run(engine, prompts, a.gen)
            r["plain_steps"] = cost.plain_steps
            acc = (spec.stats.accepted_tokens - before[0]) / max(1, spec.stats.verifies - before[1])
            report(bs, f"{name} (accept length {1 + acc:.2f})", r, plain, r["ids"] == plain["ids"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
