"""The text side of a resumed stream (issue 16): `SampleText(..., generated_ids)` stands where the
original stream stood after those ids — at every split point, through partial UTF-8 characters,
stop strings (one spanning the boundary too) and min_tokens — and the continuation's deltas join
the original's exactly. Then through `ketch.LLM.stream` on the bundled SmolLM2 (greedy, seeded)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from ketch.sampling.params import SamplingParams
from ketch.text import IncrementalDetokenizer, Tokenizer
from ketch.text.sample_text import SampleText

PROMPT = "Write a line with emoji:"
# multi-byte characters that byte-level BPE splits over several ids, so some splits fall mid-character
TEXT = " héllo 🤖🎉 wörld, 世界 ends here. Then 🤖 again and a stop word. Done 🎉!"


@dataclass
class Delta:  # what SampleText reads from an engine output
    new_token_ids: list[int]
    finished: bool = False
    matched_stop: int | str | None = None


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load()


def stream(text: SampleText, ids: list[int]) -> tuple[list[str], str | None]:
    """Push ids one at a time (the last one finishing the stream): the delta after each, and the
    stop string matched (the stream ends there)."""
    deltas: list[str] = []
    for i, token in enumerate(ids):
        delta, stopped, _ = text.push(Delta([token], finished=i == len(ids) - 1))
        deltas.append(delta)
        if stopped is not None:
            return deltas, stopped
    return deltas, None


def test_detokenizer_output_does_not_depend_on_how_ids_are_grouped(tok):
    ids = tok.encode(TEXT)
    prompt = tok.encode(PROMPT)
    one = IncrementalDetokenizer(tok, prompt)
    after = [""]  # text emitted once ids[:i] are in
    for token in ids:
        after.append(after[-1] + one.push([token]))
    assert any(after[i] == after[i + 1] for i in range(len(ids))), "no id ends mid-character: the test tests nothing"
    for seed in range(20):
        rng = random.Random(seed)
        grouped, emitted, i = IncrementalDetokenizer(tok, prompt), "", 0
        while i < len(ids):
            j = min(len(ids), i + rng.randint(1, 6))
            emitted += grouped.push(ids[i:j])
            assert emitted == after[j], (seed, i, j)
            i = j


@pytest.mark.parametrize("stop, min_tokens", [([], 0), (["stop word"], 0), (["🤖"], 0), (["🤖"], 12)],
                         ids=["no-stop", "stop-word", "stop-emoji", "stop-emoji-after-min-tokens"])
def test_resumed_text_joins_at_every_split(tok, stop, min_tokens):
    """For every k: the text the original emitted for ids[:k] is `resumed_text`, and the resumed
    stream's deltas (and stop) are the original's from there. A stop string spanning token k is
    among the splits whenever the stop string covers several ids."""
    ids = tok.encode(TEXT)
    params = SamplingParams(stop=stop, min_tokens=min_tokens, max_tokens=len(ids) + 1)
    prompt = tok.encode(PROMPT)
    whole, matched = stream(SampleText(tok, prompt, params), ids)
    assert (matched is not None) == bool(stop)
    for k in range(len(whole)):
        resumed = SampleText(tok, prompt, params, ids[:k])
        assert resumed.resumed_text == "".join(whole[:k]), k
        rest, rest_matched = stream(resumed, ids[k:])
        assert rest == whole[k:] and rest_matched == matched, k
    if stop == ["🤖"] and min_tokens:  # the first 🤖 comes before min_tokens: only the second one stops
        assert "🤖" in "".join(whole) and matched == "🤖"


def test_a_stop_string_inside_the_resumed_text_is_refused(tok):
    ids = tok.encode(TEXT)
    k = len(tok.encode(TEXT[: TEXT.index("ends") + 4]))
    with pytest.raises(ValueError, match=r"^generated_token_ids: their text contains the stop string 'ends'"):
        SampleText(tok, tok.encode(PROMPT), SamplingParams(stop=["ends"]), ids[:k + 1])


# ----------------------------------------------------------------------------- through ketch.LLM


@pytest.fixture(scope="module")
def llm():
    from ketch.llm import LLM

    model = LLM(None, dtype="float32")
    yield model
    model.close()


def deltas_per_token(llm, prompt: str, params: SamplingParams) -> tuple[list[int], list[str]]:
    """The whole run's ids, and the text the stream emitted after each id."""
    [out] = llm.generate(prompt, params)
    text = SampleText(llm.tokenizer, llm.tokenizer.encode(prompt), params)
    deltas, _ = stream(text, out.token_ids)
    return out.token_ids, deltas


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24),
    SamplingParams(temperature=0.9, top_p=0.95, seed=17, max_tokens=24, frequency_penalty=0.4),
], ids=["greedy", "seeded"])
def test_llm_stream_resumed_continues_the_text(llm, params):
    prompt = "Once upon a time, in a small village,"
    ids, deltas = deltas_per_token(llm, prompt, params)
    assert len(ids) == 24
    for k in (1, 9, 23):
        rest = "".join(llm.stream(prompt, params, ids[:k]))
        assert rest == "".join(deltas[k:]), k
    llm.engine.check_invariants()


def test_llm_stop_string_spanning_the_boundary(llm):
    """A stop string made of the end of token k - 1 and the start of token k: resumed at k, the
    stream still stops there, and what it emits joins what the original had sent."""
    prompt = "Once upon a time, in a small village,"
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    ids, _ = deltas_per_token(llm, prompt, greedy)
    pieces = [llm.tokenizer.decode(ids[: i + 1])[len(llm.tokenizer.decode(ids[:i])):] for i in range(len(ids))]
    text = "".join(pieces)
    for k in range(3, len(ids) - 2):
        a, b = pieces[k - 1], pieces[k]
        if len(a) >= 2 and len(b) >= 2 and text.find(a[-2:] + b[:2]) == len("".join(pieces[:k])) - 2:
            break
    else:
        pytest.fail(f"no stop string spans two tokens of {pieces}")
    stop = a[-2:] + b[:2]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
    _, deltas = deltas_per_token(llm, prompt, params)
    sent = "".join(deltas[:k])
    assert not sent.endswith(a[-2:])  # the original held the stop string's start back
    rest = "".join(llm.stream(prompt, params, ids[:k]))
    assert sent + rest == text[: text.index(stop)]


def test_llm_grammar_replays_the_resumed_ids(llm):
    """A constrained sample's matcher takes the resumed ids first: the continuation is the
    original's; ids the grammar would not have allowed end the request with an error naming them."""
    from ketch.sampling.grammar import GrammarSpec

    prompt = "My phone number is"
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=30,
                            grammar=GrammarSpec("regex", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"))
    ids, deltas = deltas_per_token(llm, prompt, params)
    k = len(ids) // 2
    assert "".join(deltas[:k]) + "".join(llm.stream(prompt, params, ids[:k])) == "".join(deltas)
    wrong = llm.tokenizer.encode(" hello")
    with pytest.raises(ValueError, match=r"^generated_token_ids: token 0 \(\d+\) is not allowed by the grammar"):
        list(llm.stream(prompt, params, wrong))
    llm.engine.check_invariants()
