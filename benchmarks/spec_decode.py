"""Speculative decoding A/B at batch size 1 (issue 20): plain decode vs `--speculative-algorithm`
on a copy-heavy workload ("repeat / edit this code" prompts built from ketch's own source), each
mode in a fresh engine in this process, the same prompts one at a time, greedy.

    PYTHONPATH=. python benchmarks/spec_decode.py [--modes none,ngram:4,ngram:8:always] [--max-tokens 192]
        [--prompts 6] [--dtype auto] [--device auto] [--adaptive on|off] [--batch 1] [--workload copy|chat]
        (draft: --modes none,draft:4 --draft-model PATH; a mode's third field overrides --adaptive)
        (block: the draft head's random weights; block-oracle: the same machinery with the tokens of
         the `none` run as the drafts, sure of each: the upper bound of block drafting; `none` first)

Per mode: decode tok/s (first token to last, per request, summed: the prompt's prefill is not in
it), end-to-end tok/s, mean acceptance length (tokens per verified sequence and step), whether
the greedy outputs equal the plain run's, and the speedup over `none` in this same run."""
from __future__ import annotations

import argparse
import inspect
import time

from ketch.engine.engine import Engine
from ketch.engine import speculation
from ketch.sampling import sampler
from ketch.scheduler import scheduler
from ketch.spec.oracle import OracleProposer
from ketch.sampling.params import SamplingParams
from ketch.llm import LLM
from ketch.weights.source import default_model_path

EDITS = [
    ("Repeat the following Python code exactly, without any comment:", None),
    ("Rewrite the following Python code, renaming the variable `req` to `request` everywhere:", None),
    ("Copy this code and add a type hint comment above each function, changing nothing else:", None),
]
SOURCES = [speculation.Speculation.rows, speculation.grammar_draft, sampler.edit_logits,
           scheduler.Scheduler.preempt, scheduler.Scheduler.finish, sampler._draw]


CHAT = ["What causes the seasons on Earth?", "Write a haiku about the ocean.", "Suggest a name for a coffee shop.",
        "Why is the sky blue?", "Tell me a fun fact about octopuses.", "What should I pack for a camping trip?"]


def prompts(llm: LLM, count: int, workload: str = "copy") -> list[list[int]]:
    if workload == "chat":  # answers that copy little: where speculation has little to gain
        return [llm.encode_chat([{"role": "user", "content": CHAT[i % len(CHAT)]}]) for i in range(count)]
    out = []
    for i in range(count):
        instruction, _ = EDITS[i % len(EDITS)]
        code = inspect.getsource(SOURCES[i % len(SOURCES)])
        out.append(llm.encode_chat([{"role": "user", "content": f"{instruction}\n\n```python\n{code}```"}]))
    return out


def run(engine: Engine, prompt_ids: list[list[int]], max_tokens: int, batch: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids, decode_s, decode_tokens, t_all = {}, 0.0, 0, time.perf_counter()
    for start in range(0, len(prompt_ids), batch):
        group = prompt_ids[start:start + batch]
        first, last = {}, {}
        for i, p in enumerate(group):
            engine.add_request(f"r{start + i}", p, params)
        while engine.has_unfinished():
            for o in engine.step():
                now = time.perf_counter()
                ids.setdefault(o.request_id, []).extend(o.new_token_ids)
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
        decode_s += max(last.values()) - min(first.values())
        decode_tokens += sum(len(ids[r]) - 1 for r in first)
    total = sum(len(v) for v in ids.values())
    return dict(ids=ids, decode_tps=decode_tokens / decode_s, e2e_tps=total / (time.perf_counter() - t_all), tokens=total)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="none,ngram:4,ngram:8")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None, help="the draft mode's model (default: the target's own file)")
    ap.add_argument("--adaptive", choices=("on", "off"), default="on")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--workload", choices=("copy", "chat"), default="copy")
    a = ap.parse_args()
    prompt_ids = prompts(LLM(a.model, dtype=a.dtype, device=a.device), a.prompts, a.workload)  # tokenizer, template
    print(f"{a.prompts} prompts of {min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens, "
          f"max_tokens {a.max_tokens}, batch {a.batch}, dtype {a.dtype}, adaptive {a.adaptive}", flush=True)
    base = None
    for mode in a.modes.split(","):  # ALGO[:k][:always|adaptive], e.g. ngram:4:always
        algo, k, adaptive = (mode.split(":") + ["", ""])[:3]
        oracle = algo == "block-oracle"
        algo = "block" if oracle else algo
        spec = {} if algo == "none" else dict(speculative_algorithm=algo, speculative_num_draft_tokens=int(k or 4),
                                              speculative_adaptive=(adaptive or a.adaptive) in ("on", "adaptive"))
        if algo == "draft":
            spec["speculative_draft_model_path"] = a.draft_model or a.model or default_model_path()
        engine = LLM(a.model, dtype=a.dtype, device=a.device, **spec).engine
        if oracle:
            runs = {tuple(p): base["ids"][f"r{i}"] for i, p in enumerate(prompt_ids)}
            engine.spec.proposer.oracle = OracleProposer(int(k or 4), runs)
        run(engine, prompt_ids[:1], 16, 1)  # warm-up
        r = run(engine, prompt_ids, a.max_tokens, a.batch)
        base = base or r
        st = engine.stats()
        accept = (1 + st.spec_accepted_tokens / st.spec_verifies) if st.spec_verifies else float("nan")
        same = sum(r["ids"][k] == base["ids"][k] for k in base["ids"])
        print(f"{mode:10s} decode {r['decode_tps']:7.1f} tok/s ({r['decode_tps'] / base['decode_tps']:.2f}x)  "
              f"e2e {r['e2e_tps']:7.1f} tok/s  tokens {r['tokens']}  accept length {accept:.2f}  "
              f"verifies {st.spec_verifies} plain steps {st.spec_plain_steps}  same as none {same}/{len(base['ids'])}",
              flush=True)


if __name__ == "__main__":
    main()
