"""Step time with and without a JSON-schema constraint, at a given batch size (issue: mask cost).

Each run submits B identical-length chat requests (different prompts) and times every decode
step while all B are running; the constrained run uses a schema that keeps the model writing
(an array of objects), so both runs decode the same number of steps. Reports the median step
time of each, and the added fraction.

    python benchmarks/grammar_mask_cost.py --batch-sizes 1,32 --steps 48
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import ketch.engine.engine as engine_module

from ketch import LLM, SamplingParams
from ketch.sampling.grammar import GrammarSpec

SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}


SAMPLING_SIDE = collections.Counter()  # seconds spent in the timed functions since the last reset


def _timed(owner, name: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SAMPLING_SIDE[name] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def step_times(llm: LLM, batch: int, steps: int, grammar: GrammarSpec | None) -> list[float]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, grammar=grammar)
    for i in range(batch):
        msgs = [{"role": "user", "content": f"List people as JSON, starting with person {i}."}]
        engine.add_request(f"r{i}", llm.encode_chat(msgs), params)
    times = []
    while engine.has_unfinished():
        running = len(engine.scheduler.running)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        # a pure decode step of the full batch: every running request produced one token
        if running == batch and len(outs) == batch and not engine.scheduler.waiting:
            times.append(dt)
    return times[2:]  # the first steps after prefill warm caches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None)
    a = ap.parse_args()
    _timed(engine_module.SamplingBatch, "build")
    _timed(engine_module, "sample")
    _timed(engine_module.Engine, "_check_stop")
    llm = LLM(num_threads=a.num_threads)
    grammar = GrammarSpec.json_schema(SCHEMA)
    step_times(llm, 1, 4, grammar)  # compile the grammar once, outside the timing
    for b in (int(x) for x in a.batch_sizes.split(",")):
        free, constrained = [], []
        side = {"free": 0.0, "json": 0.0}
        for _ in range(a.repeat):  # interleaved, so drifting machine load hits both alike
            for label, spec, out in (("free", None, free), ("json", grammar, constrained)):
                SAMPLING_SIDE.clear()
                out += step_times(llm, b, a.steps, spec)
                side[label] += sum(SAMPLING_SIDE.values()) / (a.steps * a.repeat)
        f, c = statistics.median(free), statistics.median(constrained)
        added = side["json"] - side["free"]
        print(f"batch {b:3d}: free {f * 1e3:7.2f} ms/step, json_schema {c * 1e3:7.2f} ms/step, "
              f"added {100 * (c - f) / f:+5.1f} % (whole step); sampling side {side['free'] * 1e3:.2f} -> "
              f"{side['json'] * 1e3:.2f} ms/step: grammar adds {added * 1e3:.2f} ms = {100 * added / f:.1f} % "
              f"of the free step  ({len(free)}/{len(constrained)} steps)", flush=True)


if __name__ == "__main__":
    main()
