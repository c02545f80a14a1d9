"""Sampling: params validation, logit edits, filters, seeded draws, logprobs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ketch.sampling.counter_rng import token_uniform
from ketch.sampling.filters import draw_
from ketch.sampling.params import SamplingParams
from ketch.sampling.sampler import (
    SamplingBatch,
    SamplingRow,
    edit_logits,
    sample,
    sample_on_device,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run(logits: torch.Tensor, rows: list[SamplingRow]):
    batch = SamplingBatch.build(rows, logits.shape[1], logits.device)
    return sample(logits, batch)


def seeded_row(seed: int, device: str, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), seed=seed)


# --------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "7"}, "seed"),
        ({"seed": 1.5}, "seed"),
        # wrong types: a ValueError naming the field, not a TypeError from a comparison inside
        ({"temperature": None}, "temperature"),
        ({"top_p": "0.9"}, "top_p"),
        ({"min_p": None}, "min_p"),
        ({"presence_penalty": None}, "presence_penalty"),
        ({"temperature": True}, "temperature"),
        ({"stop": 5}, "stop"),
        ({"stop": {"a": 1}}, "stop"),  # a dict's keys are not stop strings
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {1.7: 3.0}}, "logit_bias"),  # not token 1
        ({"logit_bias": {True: 3.0}}, "logit_bias"),  # not token 1
        ({"logit_bias": {1: True}}, "logit_bias"),
        # decimal ASCII only: not int()'s error under another name, nor a full-width digit read as 5
        ({"logit_bias": {"--5": 1.0}}, "logit_bias"),
        ({"logit_bias": {"²": 1.0}}, "logit_bias"),
        ({"logit_bias": {"-²": 1.0}}, "logit_bias"),
        ({"logit_bias": {"５": 1.0}}, "logit_bias"),
        # flags: a bool, not anything truthy
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"skip_special_tokens": "x"}, "skip_special_tokens"),
        ({"logprobs": 5}, "logprobs"),  # vLLM's count is top_logprobs here
        ({"logprobs": "yes"}, "logprobs"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_what_json_and_numpy_send_is_taken() -> None:
    """logit_bias keys as JSON's decimal strings (negative ones get the range error), numpy scalars
    as numbers."""
    import numpy as np

    assert SamplingParams(logit_bias={"42": -100, np.int64(7): 1}).logit_bias == {42: -100.0, 7: 1.0}
    assert SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9)).temperature == 0.5
    with pytest.raises(ValueError, match="^logit_bias token id -1 must be >= 0$"):
        SamplingParams(logit_bias={"-1": 1})


@pytest.mark.parametrize(
    "kwargs, field",
    [({"logit_bias": {10: 1.0}}, "logit_bias"), ({"stop_token_ids": [10]}, "stop_token_ids")],
)
def test_validation_against_vocab(kwargs: dict, field: str) -> None:
    params = SamplingParams(**kwargs)  # structurally fine
    params.validate(vocab_size=11)
    with pytest.raises(ValueError, match=rf"^{field} "):
        params.validate(vocab_size=10)


@pytest.mark.parametrize("field, value", [("stop", None), ("stop", "x"), ("stop_token_ids", None), ("stop_token_ids", 7)])
def test_a_stop_field_set_after_construction_is_a_value_error_naming_it(field: str, value: object) -> None:
    """__post_init__ makes both lists; one set later was a TypeError from len() inside the engine."""
    setattr(params := SamplingParams(), field, value)
    with pytest.raises(ValueError, match=rf"^{field} must be a list"):
        params.validate(vocab_size=100)


def test_params_normalization() -> None:
    assert SamplingParams().stop == []
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop_token_ids == []
    assert SamplingParams(logit_bias={"5": -100, 7: 2}).logit_bias == {5: -100.0, 7: 2.0}
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(top_k=0).is_greedy and not SamplingParams(top_k=-1).is_greedy


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_exact_argmax_and_top_k_1_is_greedy(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 500, device=device)
    top = logits.argmax(-1).tolist()
    rows = [
        SamplingRow(SamplingParams(temperature=0)),
        SamplingRow(SamplingParams(top_k=1, temperature=0.9), seed=1),
        seeded_row(2, device, temperature=1.0),  # sampled batch mate
        # greedy after an edit: each one aimed at the row's top token (or the one it should become)
        SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.3), prompt_ids=[top[3]], output_ids=[5]),
        SamplingRow(SamplingParams(temperature=0, logit_bias={3: 5.0})),
        SamplingRow(SamplingParams(temperature=0, frequency_penalty=1.0), output_ids=[top[5]] * 2),
    ]
    before = logits.clone()
    out = run(logits, rows)
    assert torch.equal(logits, before), "sample must not modify its input"
    # The edited rows' argmax, from the formulas applied by hand (penalties.py's docstring).
    edited = logits.cpu().clone()
    for t in (top[3], 5):
        edited[3, t] = edited[3, t] / 1.3 if edited[3, t] > 0 else edited[3, t] * 1.3
    edited[4, 3] += 5.0
    edited[5, top[5]] -= 1.0 * 2
    expected = top[:3] + edited[3:].argmax(-1).tolist()
    assert all(e != t for e, t in zip(expected[3:], top[3:], strict=True)), "an edit that changes no pick tests nothing"
    assert out.token_ids[:2] == expected[:2]
    assert out.token_ids[3:] == expected[3:]
    assert out.logprobs is None and out.top_ids is None


# --------------------------------------------------------------------------- seeded draws


def _sequence(
    device: str, steps: list[torch.Tensor], position: int, mates: list[SamplingRow]
) -> list[int]:
    """Run the seeded request at `position` among `mates` over several steps."""
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234)
    tokens = []
    for k, step_logits in enumerate(steps):
        rows = list(mates)
        rows.insert(position, SamplingRow(params, seed=1234, num_output=k))
        logits = torch.randn(len(rows), step_logits.shape[0], device=device)
        logits[position] = step_logits
        tokens.append(run(logits, rows).token_ids[position])
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_reproduce_regardless_of_batch(device: str) -> None:
    torch.manual_seed(0)
    steps = [torch.randn(300, device=device) * 0.5 for _ in range(6)]
    alone = _sequence(device, steps, 0, [])
    mates = [
        SamplingRow(SamplingParams(temperature=0)),
        seeded_row(7, device, temperature=1.3, min_p=0.1),
        SamplingRow(SamplingParams(temperature=1.0), seed=None),
        SamplingRow(SamplingParams(temperature=0.5, presence_penalty=1.0), output_ids=[1, 2]),
    ]
    assert _sequence(device, steps, 2, mates) == alone
    assert _sequence(device, steps, 1, mates[::-1][:2]) == alone
    assert _sequence(device, steps, 4, mates) == alone
    assert _sequence(device, steps, 0, mates[1:3]) == alone  # all rows sampled (no index)
    assert len(set(alone)) > 1, "flat enough logits should give varied tokens"


def test_token_uniform_is_a_function_of_seed_and_index() -> None:
    values = [[token_uniform(seed, k) for k in range(200)] for seed in range(50)]
    flat = np.array(values).ravel()
    assert np.all((flat > 0) & (flat < 1))
    # distinct over the grid: sample seed+1 is not sample seed shifted by a token, and no index repeats
    assert len(set(flat.tolist())) == flat.size
    counts = np.bincount((flat * 10).astype(int), minlength=10) / flat.size
    assert np.abs(counts - 0.1).max() < 0.015, counts.round(3)
    assert token_uniform(7, 3) == token_uniform(7, 3)  # no state anywhere
    assert 0 < token_uniform(-(2**63), 0) < 1 and token_uniform(-1, 0) != token_uniform(1, 0)  # negative seeds


@pytest.mark.parametrize("device", DEVICES)
def test_a_token_draws_the_same_whatever_came_before(device: str) -> None:
    """Token k of a seeded sample depends on (seed, k) only: drawn in a fresh process after the
    first k tokens (a resumed stream) it is the token the whole run drew."""
    torch.manual_seed(0)
    steps = [torch.randn(300, device=device) * 0.5 for _ in range(8)]
    params = SamplingParams(temperature=1.0, seed=5)
    whole = [run(s.unsqueeze(0), [SamplingRow(params, seed=5, num_output=k)]).token_ids[0]
             for k, s in enumerate(steps)]
    for k in (3, 7):  # alone, no earlier draw: the same token
        assert run(steps[k].unsqueeze(0), [SamplingRow(params, seed=5, num_output=k)]).token_ids[0] == whole[k]
    other = [run(s.unsqueeze(0), [SamplingRow(params, seed=6, num_output=k)]).token_ids[0]
             for k, s in enumerate(steps)]
    assert other != whole, "the next seed (sample i + 1 of n) must draw differently"
    assert len(set(whole)) > 1


def test_draw_never_picks_a_zero_probability_token() -> None:
    # Leading and trailing tokens filtered out (probability 0); the uniforms at both ends of
    # (0, 1) and at 1.0 itself (the target at the CDF's top: a search would run past the end).
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.7, 0.0, 0.0]] * 4)
    uniform = torch.tensor([[2.0**-53], [0.3], [1 - 2.0**-53], [1.0]], dtype=torch.float64)
    picked = draw_(probs.clone(), uniform).tolist()
    assert picked[:2] == [2, 2] and picked[2] == 3
    assert picked[3] == 3  # never token 5, whose probability is 0


@pytest.mark.parametrize("device", DEVICES)
def test_knobs_past_float32s_range_draw_the_best_token_not_nan(device: str) -> None:
    """A top_p or repetition_penalty below float32's range (they are float32 on the device: 1e-46
    is 0 there; 1e-39 is subnormal, 0 where denormals are flushed) is near-greedy, not a NaN softmax that falls back to token 0. Token 3
    is the best after each row's knobs: top_p keeps it alone; the penalty puts the prompt's token 3
    past every other logit (saturated: l / r overflows), also at a temperature below 1, where
    even the saturated logit would overflow once divided."""
    vals = [0.5, 1.0, 2.5, 2.0, -1.0, 0.0]  # token 2 is the raw best
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0, 0.0]] + [vals] * 2, device=device)
    rows = [seeded_row(7, device, temperature=1.0, top_p=1e-46)]
    rows += [SamplingRow(SamplingParams(temperature=t, repetition_penalty=1e-46), prompt_ids=[3], seed=7)
             for t in (1.0, 0.5)]
    assert run(logits, rows).token_ids == [3, 3, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_rows_differ(device: str) -> None:
    logits = torch.zeros(1, 5000, device=device)  # uniform over 5000 tokens
    runs = []
    for _ in range(2):
        row = SamplingRow(SamplingParams())  # no seed: fresh OS randomness per draw
        runs.append([run(logits, [row]).token_ids[0] for _ in range(5)])
    assert runs[0] != runs[1]
    # ... so rows without a seed differ from each other too.
    out = run(logits.expand(4, -1), [SamplingRow(SamplingParams())] * 4).token_ids
    assert len(set(out)) > 1


# --------------------------------------------------------------------------- edits


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_forces_and_bans(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 100, device=device)
    top = logits.argmax(-1).tolist()
    rows = [
        SamplingRow(SamplingParams(temperature=0, logit_bias={"7": 100})),
        seeded_row(0, device, logit_bias={7: 100}),
        SamplingRow(SamplingParams(temperature=0, logit_bias={top[2]: -100})),
        seeded_row(1, device, temperature=0, logit_bias={top[3]: -100}),
    ]
    out = run(logits, rows)
    assert out.token_ids[:2] == [7, 7]
    assert out.token_ids[2] != top[2] and out.token_ids[3] != top[3]
    # Sampled: a banned token is never drawn even when it dominates.
    logits = torch.zeros(200, 10, device=device)
    logits[:, 4] = 8.0
    rows = [seeded_row(i, device, logit_bias={4: -100}) for i in range(200)]
    assert 4 not in run(logits, rows).token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_bans_eos_and_stop_ids(device: str) -> None:
    eos, stop = 5, 6
    logits = torch.zeros(5, 10, device=device)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop])
    p_ignore = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    rows = [
        SamplingRow(p, num_output=0, eos_ids=(eos,)),
        SamplingRow(p, output_ids=[1, 2], eos_ids=(eos,)),  # num_output from output_ids
        SamplingRow(p, num_output=3, eos_ids=(eos,)),  # min_tokens reached: no ban
        SamplingRow(p_ignore, num_output=0, eos_ids=(eos,)),  # eos never banned, stop is
        SamplingRow(SamplingParams(min_tokens=3, stop_token_ids=[stop]), num_output=0,
                    eos_ids=(eos,), seed=0),
    ]
    out = run(logits, rows)
    assert out.token_ids[0] not in (eos, stop)
    assert out.token_ids[1] not in (eos, stop)
    assert out.token_ids[2] == eos
    assert out.token_ids[3] == eos
    assert out.token_ids[4] not in (eos, stop)


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_follow_the_formulas(device: str) -> None:
    vals = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
    logits = torch.tensor([vals] * 4, device=device)
    prompt, output = [1, 2], [2, 3, 3]
    rows = [
        SamplingRow(SamplingParams(repetition_penalty=1.5), prompt_ids=prompt, output_ids=output),
        SamplingRow(
            SamplingParams(frequency_penalty=0.5, presence_penalty=0.3),
            prompt_ids=prompt,
            output_ids=output,
        ),
        SamplingRow(
            SamplingParams(repetition_penalty=2.0, frequency_penalty=-0.5, presence_penalty=1.0),
            prompt_ids=prompt,
            output_ids=output,
        ),
        SamplingRow(SamplingParams(), prompt_ids=prompt, output_ids=output),  # untouched
    ]
    batch = SamplingBatch.build(rows, 6, device)
    got = edit_logits(logits, batch).cpu()

    def rep(x: float, r: float) -> float:
        return x / r if x > 0 else x * r

    counts = {2: 1, 3: 2}
    expected = [list(vals) for _ in range(4)]
    for t in (1, 2, 3):  # prompt + output
        expected[0][t] = rep(vals[t], 1.5)
        expected[2][t] = rep(vals[t], 2.0)
    for t, c in counts.items():  # output only
        expected[1][t] = vals[t] - 0.5 * c - 0.3
        expected[2][t] = expected[2][t] + 0.5 * c - 1.0
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-6)
    assert torch.equal(got[3], logits[3].cpu())  # neutral rows stay bit-exact
    # The penalized tokens lose probability, as they should.
    assert got[0].softmax(-1)[3] < logits[0].cpu().softmax(-1)[3]
    assert got[1].softmax(-1)[3] < got[1].softmax(-1)[2] * math.exp(vals[3] - vals[2])


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_and_sorted(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50, device=device) * 3
    rows = [
        seeded_row(0, device, temperature=0.5, logprobs=True, top_logprobs=5, logit_bias={1: 50}),
        SamplingRow(SamplingParams(temperature=0, logprobs=True, repetition_penalty=1.2),
                    output_ids=[0, 1]),
        SamplingRow(SamplingParams(temperature=0)),  # didn't ask, still gets them
    ]
    out = run(logits, rows)
    raw = logits.log_softmax(-1).cpu()
    assert out.token_ids[0] == 1  # the bias changed the pick, not the reported logprob
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-6)
        assert len(out.top_ids[i]) == 5
        assert out.top_logprobs[i] == sorted(out.top_logprobs[i], reverse=True)
        assert out.top_ids[i] == raw[i].topk(5).indices.tolist()
        assert out.top_logprobs[i] == pytest.approx(raw[i].topk(5).values.tolist(), abs=1e-6)


def test_logprobs_without_top_and_device_tokens() -> None:
    logits = torch.randn(2, 30)
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=True))] * 2
    batch = SamplingBatch.build(rows, 30, "cpu")
    dev = sample_on_device(logits, batch)
    assert dev.token_ids.dtype == torch.int64 and dev.token_ids.shape == (2,)
    out = dev.to_host()
    assert out.top_ids is None and out.top_logprobs is None
    assert out.logprobs is not None and len(out.logprobs) == 2


def test_strided_logits_view() -> None:
    # The runner may hand over a slice of vocab-padded logits; edits must still land right.
    padded = torch.randn(3, 64)
    logits = padded[:, :50]
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={49: 100}))] * 3
    assert run(logits, rows).token_ids == [49, 49, 49]
    assert torch.equal(padded[:, :50], logits)
