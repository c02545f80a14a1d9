"""Speculative decoding's parts on their own: the n-gram proposer, the host's accept rule, the
cost model's decisions, the config checks. The engine-level tests are test_spec_engine.py."""
from __future__ import annotations

import numpy as np
import pytest

from ketch.config import EngineConfig
from ketch.spec.cost_model import BLOCK_STEPS, PROBE_BUDGET, PROBE_EVERY, SpecCostModel
from ketch.spec.ngram import NgramProposer
from ketch.spec.proposer import DraftInput
from ketch.spec.verify import accepted_rows


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def brute_lookup(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, spelled out: the longest suffix (max_n down to min_n) that occurs earlier
    with a token after it; the continuation of its latest such occurrence."""
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        suffix = seq[-n:]
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i:i + n] == suffix:
                return seq[i + n:i + n + k]
    return []


def test_ngram_copies_what_followed_the_latest_longest_match() -> None:
    p = NgramProposer(num_draft_tokens=3, min_n=1, max_n=4)
    # "5 6" occurred twice; the suffix "4 5 6" only once: its continuation wins
    assert p.lookup(ids(4, 5, 6, 7, 8, 9, 5, 6, 1, 2, 4, 5, 6), 3) == [7, 8, 9]
    # two occurrences of the same suffix: the most recent one's continuation
    assert p.lookup(ids(1, 2, 3, 1, 2, 4, 1, 2), 3) == [4, 1, 2]
    assert p.lookup(ids(1, 2, 3), 3) == []  # no earlier occurrence of the last token
    assert p.lookup(ids(7, 7), 3) == [7]  # the continuation stops at the end
    assert p.lookup(ids(1, 2, 1), 0) == []  # no room


def test_ngram_min_window_refuses_short_matches() -> None:
    p = NgramProposer(num_draft_tokens=2, min_n=3, max_n=5)
    assert p.lookup(ids(1, 2, 9, 9, 2), 2) == []  # only "2" matches
    assert p.lookup(ids(1, 2, 3, 8, 1, 2, 3), 2) == [8, 1]


def test_ngram_matches_a_brute_force_definition_on_random_sequences() -> None:
    rng = np.random.default_rng(0)
    for trial in range(400):
        seq = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 6))
        got = NgramProposer(k, lo, hi).lookup(np.array(seq, dtype=np.int64), k)
        assert got == brute_lookup(seq, k, lo, hi), (trial, seq, k, lo, hi)


def test_propose_caps_each_draft_at_its_room() -> None:
    p = NgramProposer(num_draft_tokens=4)
    seq = ids(1, 2, 3, 4, 5, 6, 1)
    assert p.propose([DraftInput(seq, 2), DraftInput(seq, 9), DraftInput(seq, 0)]) == [[2, 3], [2, 3, 4, 5], []]


def test_accepted_rows_is_one_plus_the_agreeing_prefix() -> None:
    assert accepted_rows([5, 6, 7], [5, 6, 7, 8]) == 4  # all kept, plus the target's token
    assert accepted_rows([5, 6, 7], [5, 9, 7, 8]) == 2  # row 1 disagreed: its token is the last
    assert accepted_rows([5, 6, 7], [1, 6, 7, 8]) == 1
    assert accepted_rows([], [3]) == 1


def run_blocks(m: SpecCostModel, batch_size: int, blocks: int, step_s: dict[bool, float],
               tokens_per_seq: dict[bool, float], clock: list[float]) -> list[bool]:
    """Drive the model as the engine does: ask the mode, launch, yield; each step takes the
    mode's time and yields its tokens. Returns the mode of every step."""
    modes = []
    for _ in range(blocks * BLOCK_STEPS):
        spec = m.should_speculate(batch_size)
        m.launched(clock[0], batch_size, decode_only=True, speculating=spec)
        m.yielded(round(batch_size * tokens_per_seq[spec]))
        clock[0] += step_s[spec]
        modes.append(spec)
    return modes


def test_cost_model_turns_speculation_off_where_it_loses_and_probes_it_again() -> None:
    m, clock = SpecCostModel(), [0.0]
    # bs 8: a speculating step takes 30 ms for 1.25 tokens per sequence, a plain one 20 ms for 1
    lose = run_blocks(m, 8, 2 + 16 * PROBE_EVERY, {True: 0.030, False: 0.020}, {True: 1.25, False: 1.0}, clock)
    # a block is BLOCK_STEPS steps and one more that closes it, in the same mode
    span = BLOCK_STEPS + 1
    assert lose[:span] == [True] * span  # measured first ...
    assert lose[span:2 * span] == [False] * span  # ... then the plain side
    assert not m.pays(8)
    later = lose[2 * span:]
    # off, but probed: after PROBE_EVERY blocks, then after twice as many, four times, ...
    starts = [i for i in range(1, len(later)) if later[i] and not later[i - 1]]
    gaps = [(b - a) // span - 1 for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and gaps == [PROBE_EVERY * 2 ** (i + 1) for i in range(len(gaps))], (starts, gaps)
    assert m.pays(2)  # another bucket knows nothing yet
    # the workload turns copy-heavy: 3 tokens per speculating step pays, and the probes find it
    win = run_blocks(m, 8, 20 * PROBE_EVERY, {True: 0.030, False: 0.020}, {True: 3.0, False: 1.0}, clock)
    assert m.pays(8) and win[-span:] == [True] * span
    assert win.count(False) < len(win) // 2


def test_probes_stay_within_their_budget_where_a_verify_is_dear() -> None:
    """bs 64: a speculating step takes 5 plain steps' time and keeps no draft (a verify of k = 4 is
    320 rows). Once both sides are measured, the probes' extra time is at most PROBE_BUDGET of the
    plain time between them (a probe block runs BLOCK_STEPS steps and the one that closes it);
    doubling the wait alone (up to 64 blocks) spent ~8 % here."""
    m, clock = SpecCostModel(), [0.0]
    modes = run_blocks(m, 64, 600, {True: 0.050, False: 0.010}, {True: 1.0, False: 1.0}, clock)
    later = modes[2 * (BLOCK_STEPS + 1):]  # after the first speculating and plain blocks
    assert later.count(True) >= BLOCK_STEPS  # it still probes
    extra, plain = later.count(True) * (0.050 - 0.010), later.count(False) * 0.010
    assert extra <= PROBE_BUDGET * plain * (BLOCK_STEPS + 1) / BLOCK_STEPS, (extra, plain)


def test_cost_model_drops_blocks_a_prompt_chunk_interrupts() -> None:
    m, clock = SpecCostModel(), [0.0]
    for _ in range(BLOCK_STEPS - 1):
        m.launched(clock[0], 4, True, m.should_speculate(4))
        m.yielded(40)  # absurdly many tokens: a block that kept them would favour speculation forever
        clock[0] += 0.01
    m.launched(clock[0], 4, False, m.should_speculate(4))  # a prompt chunk: the block is dropped
    assert m._block is None and 4 not in m.buckets or m.buckets[4].rate == {}


@pytest.mark.parametrize("kw, field", [
    (dict(speculative_algorithm="eagle"), "speculative_algorithm"),
    (dict(speculative_num_draft_tokens=3), "speculative_num_draft_tokens (--speculative-num-draft-tokens) needs"),
    (dict(speculative_algorithm="ngram", speculative_num_draft_tokens=0), "speculative_num_draft_tokens"),
    # B x k x vocab logits each step: 50,000 had the engine killed at its first request
    (dict(speculative_algorithm="block", speculative_num_draft_tokens=65), "speculative_num_draft_tokens: 'block'"),
    (dict(speculative_algorithm="ngram", speculative_ngram_min_match_window_size=4,
          speculative_ngram_max_match_window_size=2), "speculative_ngram_max_match_window_size"),
    (dict(speculative_algorithm="draft"), "--speculative-draft-model-path"),
    (dict(speculative_algorithm="ngram", speculative_draft_model_path="x.gguf"), "speculative_draft_model_path"),
    (dict(speculative_algorithm="ngram", disaggregation_mode="prefill"), "prefill server"),
    (dict(speculative_algorithm="block", speculative_draft_model_path="head.gguf"), "a .safetensors file"),
    (dict(speculative_algorithm="ngram", tensor_parallel_size=2), "tensor_parallel_size"),
    # the CLI's word: a truthy string kept the cost model on without a word
    (dict(speculative_algorithm="ngram", speculative_adaptive="off"), "speculative_adaptive must be a bool"),
])
def test_config_errors_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**kw)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_config_path, tmp_path):
    import json

    from conftest import TINY_LLAMA, make_tiny_engine

    other = tmp_path / "config.json"
    other.write_text(json.dumps(dict(TINY_LLAMA, vocab_size=256)))
    with pytest.raises(ValueError, match="speculative_draft_model_path: the draft's vocab_size 256 differs"):
        make_tiny_engine(tiny_config_path, speculative_algorithm="draft", speculative_draft_model_path=str(other))
    missing = str(tmp_path / "nope.gguf")  # the loader's own error, under the field that named the path
    with pytest.raises(ValueError, match=f"^speculative_draft_model_path: path '{missing}' does not exist"):
        make_tiny_engine(tiny_config_path, speculative_algorithm="draft", speculative_draft_model_path=missing)


def test_the_draft_model_runs_again_only_what_it_never_ran(tiny_config_path):
    """The draft model's prefix cache keeps the drafts it ran: when the target keeps all of them,
    the next propose runs only the last draft (never run) and the target's own token; when it
    keeps one, only the target's correction, as decode rows (a decode step, not an extend that
    gathers the context). The drafts equal a fresh draft model's (the cached K/V of drafts is the
    K/V of those tokens), and every page is back after each call."""
    import numpy as np

    from conftest import make_tiny_engine
    from ketch.forward_batch import StepKind

    def draft_engine():
        return make_tiny_engine(tiny_config_path, speculative_algorithm="draft", speculative_num_draft_tokens=4,
                                speculative_draft_model_path=tiny_config_path, speculative_adaptive=False)

    proposer = draft_engine().spec.proposer
    ran: list[int] = []
    kinds: list[StepKind] = []
    forward = proposer.runner.forward

    def counting_forward(batch):  # a spy on the real forward: how many tokens each draft forward ran
        ran.append(batch.num_tokens)
        kinds.append(batch.kind)
        return forward(batch)

    proposer.runner.forward = counting_forward
    prompt = np.arange(3, 40, dtype=np.int64)
    first = proposer.propose([DraftInput(prompt, 4)])[0]
    assert len(first) == 4 and ran == [len(prompt), 1, 1, 1]
    assert kinds[0] is StepKind.EXTEND  # a new prompt
    proposer.check_invariants()
    for kept, runs_first in ((first + [7], 2), (first[:1] + [(first[1] + 1) % 64], 1)):
        ran.clear()
        kinds.clear()
        seq = np.concatenate([prompt, np.array(kept, dtype=np.int64)])
        drafts = proposer.propose([DraftInput(seq, 4)])[0]
        assert ran[0] == runs_first and kinds == [StepKind.DECODE] * 4, (ran, kinds)
        assert drafts == draft_engine().spec.proposer.propose([DraftInput(seq, 4)])[0]
        proposer.check_invariants()
