"""Stop strings and stop token ids through `ketch.LLM` on the bundled SmolLM2 GGUF in fp32: a stop
across a token boundary, several stops (the first to complete wins), one completed by the very
last generated token (at max_tokens, and right before EOS), min_tokens. Greedy throughout, and
every stop string is cut from the model's own unconstrained output, so each assertion is exact.
"""
from __future__ import annotations

import pytest

from conftest import assert_drained
from test_llm import P_STORY, SHORT_ANSWER, greedy, llm, tok  # noqa: F401 (the module's fixtures, shared)


def _token_texts(tok, ids: list[int]) -> list[str]:
    """Each token's share of decode(ids), so that "".join(result) == decode(ids)."""
    prefixes = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    return [prefixes[i + 1][len(prefixes[i]):] for i in range(len(ids))]


def test_stop_string_across_a_token_boundary(llm, tok):
    base = llm.generate(P_STORY, greedy(max_tokens=16))[0]
    ids, text = base.token_ids, base.text
    pieces = _token_texts(tok, ids)
    assert "".join(pieces) == text
    for k in range(2, len(ids) - 4):  # stop = end of token k + start of token k+1
        a, b = pieces[k], pieces[k + 1]
        stop, start = a[-2:] + b[:2], len("".join(pieces[: k + 1])) - 2
        if len(a) >= 2 and len(b) >= 3 and text.find(stop) == start and text.find(b[1:]) == start + 3:
            break
    else:
        pytest.fail(f"no stop string spans two tokens of {pieces}")

    [out] = llm.generate(P_STORY, greedy(max_tokens=16, stop=[stop]))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.matched_stop == stop
    assert c.text == text[:start] and stop not in c.text
    assert c.token_ids == ids[: k + 2]  # generation ends at the token that completes the stop
    assert_drained(llm.engine)
    assert "".join(llm.stream(P_STORY, greedy(max_tokens=16, stop=[stop]))) == text[:start]
    assert_drained(llm.engine)

    # Several stop strings: the one that completes first wins, whatever the list order — also
    # against `inside`, which arrives in the same token as the end of `stop` but completes later.
    later = pieces[k + 3].strip()
    later_at = text.find(later)
    assert len(later) >= 2 and later_at > start + len(stop)
    inside = pieces[k + 1][1:]
    for other, at in ((later, later_at), (inside, start + 3)):
        [alone] = llm.generate(P_STORY, greedy(max_tokens=16, stop=[other]))  # it does match by itself
        assert alone.outputs[0].matched_stop == other and alone.text == text[:at]
        for stops in ([other, stop], [stop, other]):
            [out] = llm.generate(P_STORY, greedy(max_tokens=16, stop=stops))
            assert out.outputs[0].matched_stop == stop and out.text == text[:start]
            assert out.finish_reason == "stop"
    assert_drained(llm.engine)

    # A stop string that starts at the text's end but never completes: the held-back tail comes out.
    tail_stop = text[-2:] + "@@"
    assert tail_stop not in text
    [out] = llm.generate(P_STORY, greedy(max_tokens=16, stop=[tail_stop]))
    assert out.finish_reason == "length" and out.outputs[0].matched_stop is None and out.text == text
    assert "".join(llm.stream(P_STORY, greedy(max_tokens=16, stop=[tail_stop]))) == text
    assert_drained(llm.engine)


def _unique_suffix(text: str, shortest: int = 2) -> str:
    """The shortest tail of `text` (at least `shortest` characters) found nowhere earlier in it."""
    k = next(k for k in range(shortest, len(text) + 1) if text.find(text[-k:]) == len(text) - k)
    return text[-k:]


def test_stop_string_completed_by_the_last_token_at_max_tokens(llm, tok):
    base = llm.generate(P_STORY, greedy(max_tokens=16))[0]
    assert base.finish_reason == "length" and _token_texts(tok, base.token_ids)[-1].strip()
    stop = _unique_suffix(base.text)  # it completes in the 16th token, the one that finishes the sample
    [out] = llm.generate(P_STORY, greedy(max_tokens=16, stop=[stop]))
    c = out.outputs[0]
    assert (c.finish_reason, c.matched_stop, c.text) == ("stop", stop, base.text[: -len(stop)])
    assert c.token_ids == base.token_ids
    assert "".join(llm.stream(P_STORY, greedy(max_tokens=16, stop=[stop]))) == base.text[: -len(stop)]
    assert_drained(llm.engine)


def test_stop_string_completed_by_the_token_before_eos(llm, tok):
    """Here the engine's deltas hold one token, so the stop completes one delta before the finishing
    one; test_text covers a finishing delta that carries both the stop's last token and EOS."""
    base = llm.chat(SHORT_ANSWER, greedy(max_tokens=16))[0]
    assert base.finish_reason == "stop" and base.token_ids[-1] in llm.engine.eos_ids
    stop = _unique_suffix(base.text, shortest=1)  # completes in the token right before EOS
    [out] = llm.chat(SHORT_ANSWER, greedy(max_tokens=16, stop=[stop]))
    c = out.outputs[0]
    assert (c.finish_reason, c.matched_stop, c.text) == ("stop", stop, base.text[: -len(stop)])
    assert c.token_ids == base.token_ids[:-1]  # ended by the stop string, before EOS was sampled
    assert_drained(llm.engine)


def test_stop_token_ids(llm, tok):
    base = llm.generate(P_STORY, greedy(max_tokens=16))[0].token_ids
    k = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    [out] = llm.generate(P_STORY, greedy(max_tokens=16, stop_token_ids=[base[k]]))
    assert out.finish_reason == "stop" and out.outputs[0].matched_stop == base[k]
    # the stop token ends the output; like a stop string, its text is not part of it
    assert out.token_ids == base[: k + 1] and out.text == tok.decode(base[:k])
    assert_drained(llm.engine)


def test_stop_strings_wait_for_min_tokens(llm, tok):
    base = llm.generate(P_STORY, greedy(max_tokens=12))[0]
    early = tok.decode(base.token_ids[:2])[-3:]  # completes within the first two tokens
    [cut] = llm.generate(P_STORY, greedy(max_tokens=12, stop=[early]))
    assert cut.finish_reason == "stop" and len(cut.token_ids) <= 2
    [out] = llm.generate(P_STORY, greedy(max_tokens=12, min_tokens=6, stop=[early]))
    assert len(out.token_ids) >= 6
    assert_drained(llm.engine)
