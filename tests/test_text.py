"""Text: tokenizer, chat template parity with transformers, incremental detokenizer, stop strings."""
from __future__ import annotations

import json
import random

import pytest

from ketch.engine.outputs import EngineOutput
from ketch.sampling.params import SamplingParams
from ketch.text import (
    ChatTemplate,
    IncrementalDetokenizer,
    StopChecker,
    Tokenizer,
    TokenizerUnavailable,
    render_chat,
)
from ketch.text.sample_text import SampleText


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load()


# --- tokenizer ----------------------------------------------------------------------------------


def test_smollm2_tokenizer_fields(tok):
    assert tok.eos_token_ids == (2,)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.vocab_size == 49152
    assert {0, 1, 2} <= set(tok.all_special_ids)
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_encode_decode(tok):
    text = "Hello world, café 😀"
    ids = tok.encode(text, add_special_tokens=True)
    assert ids == tok.encode(text, add_special_tokens=False)  # SmolLM2 adds no BOS
    assert tok.decode(ids) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # special tokens are matched whole, not split
    assert tok.decode(ids) == "user\nhi" and tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_hf_directory_tokenizer_matches_gguf_one(tok, tmp_path):
    tok.hf.save_pretrained(tmp_path)
    other = Tokenizer.load(str(tmp_path))
    for text in ["Hello world", "日本語 😀 naïve", "<|im_start|>assistant\n"]:
        assert other.encode(text) == tok.encode(text)
    assert other.chat_template == tok.chat_template and other.eos_token_ids == tok.eos_token_ids


def test_dummy_models_have_no_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for path in (str(tmp_path), str(tmp_path / "config.json")):
        with pytest.raises(TokenizerUnavailable, match="token ids"):
            Tokenizer.load(path)
    assert issubclass(TokenizerUnavailable, ValueError)
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.load(str(tmp_path / "missing.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="model: cannot build a tokenizer"):
        Tokenizer.load(str(tmp_path / "bad.gguf"))


class _FakeHF:
    """The slice of a transformers tokenizer that Tokenizer reads, with a Llama-3-style template."""

    chat_template = "{% for m in messages %}<|start_header_id|>{{ m['content'] }}<|eot_id|>{% endfor %}"
    bos_token, eos_token, eos_token_id, unk_token_id = "<|begin_of_text|>", "<|end_of_text|>", 128001, None
    all_special_ids = [128000, 128001, 128009]
    _vocab = {"<|eot_id|>": 128009, "<|end_of_text|>": 128001}

    def __len__(self) -> int:
        return 128256

    def convert_tokens_to_ids(self, token: str):
        return self._vocab.get(token)


def test_eos_ids_include_the_templates_end_of_turn_token():
    assert Tokenizer(_FakeHF()).eos_token_ids == (128001, 128009)
    base = _FakeHF()
    base.chat_template = None  # a base model stops on eos alone
    assert Tokenizer(base).eos_token_ids == (128001,)


# --- chat template ------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with émoji 😀?"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, messages, gen):
    ours = render_chat(tok.chat_template, messages, add_generation_prompt=gen, bos_token=tok.bos_token, eos_token=tok.eos_token)
    assert ours == tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.endswith("<|im_start|>assistant\n") == gen


def test_content_parts_are_flattened(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]}]
    flat = [{"role": "user", "content": "line one\nline two"}]
    assert render_chat(tok.chat_template, parts) == render_chat(tok.chat_template, flat)


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hi", "non-empty list"),
        ([], "non-empty list"),
        (["hi"], r"messages\[0\]: expected an object"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content: missing"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content: expected"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"content\[0\].*image_url"),
        ([{"role": "user", "content": None}], "null"),
        ([{"role": "user", "content": []}], r"messages\[0\]\.content: an empty list"),
        ([{"role": "user", "content": "x", "name": 5}], r"messages\[0\]\.name: expected a string"),
    ],
)
def test_bad_messages_are_value_errors(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(tok.chat_template, messages)


def test_template_helpers_and_errors():
    t = ChatTemplate(
        "{% if messages|length > 1 %}{{ raise_exception('only one message, please') }}{% endif %}"
        "{{ bos_token }}{{ strftime_now('%Y') }}|{{ tools|tojson }}|{{ extra }}"
        "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"
    )
    out = t.render([{"role": "user", "content": "x"}], tools=[{"name": "a<b>&'c'"}], bos_token="<s>", extra=7)
    assert out.startswith("<s>2") and out.endswith("|[{\"name\": \"a<b>&'c'\"}]|7x")  # tojson does not HTML-escape
    with pytest.raises(ValueError, match="messages: only one message"):
        t.render([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    with pytest.raises(ValueError, match="chat_template: syntax error"):
        ChatTemplate("{% for %}")
    assert ChatTemplate("{{ tools }}").render([{"role": "user", "content": "x"}]) == "None"


def test_whitespace_tojson_and_loop_controls_like_transformers(tok):
    template = (
        "{% for m in messages %}\n    {% if true %}\n[{{ m['content'] }}]\n    {% endif %}\n{% endfor %}"
        "{{ tools|tojson }}|{{ tools|tojson(indent=2) }}|{% for x in [1, 2, 3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    tools = [{"type": "function", "function": {"name": "f<x>&'y'", "description": "é"}}]
    ours = render_chat(template, messages, add_generation_prompt=False, tools=tools)
    assert ours.startswith("[a]\n[b]\n[{") and ours.endswith("|13")
    assert ours == tok.hf.apply_chat_template(messages, chat_template=template, tokenize=False, tools=tools)


# --- incremental detokenizer --------------------------------------------------------------------


def _stream(tok, prompt, output, skip=True, chunks=None):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces, i = [], 0
    for n in chunks or [1] * len(output):
        pieces.append(detok.push(output[i : i + n]))
        i += n
    pieces.append(detok.flush())
    return pieces


@pytest.fixture(scope="module")
def fragment_ids(tok):
    """Ids that decode to an incomplete UTF-8 piece on their own, plus the special tokens."""
    return [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])] + [0, 1, 2, 3]


def test_detokenizer_equals_full_decode_on_random_ids(tok, fragment_ids):
    rng = random.Random(0)
    for trial in range(400):
        pool = fragment_ids if trial % 2 else range(tok.vocab_size)
        prompt = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
        output = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        chunks = []
        while sum(chunks) < len(output):
            chunks.append(min(rng.randint(1, 3), len(output) - sum(chunks)))
        skip = trial % 3 != 0
        assert "".join(_stream(tok, prompt, output, skip, chunks)) == tok.decode(output, skip_special_tokens=skip), (prompt, output)


TEXTS = [
    "Hello, world!",
    "Café naïve résumé façade Ångström",
    "日本語のテキストと中文字符，还有한국어",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷",
    "mixed: 😀 café 你好 Ωμέγα ∑ ∞ → done",
    "  leading spaces\n\ttabs\n\nnewlines ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_streams_unicode_one_token_at_a_time(tok, text):
    prompt = tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": "hi"}]))
    output = tok.encode(text, add_special_tokens=False)
    pieces = _stream(tok, prompt, output)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)  # never a broken character on the way
    assert pieces[-1] == ""  # nothing was left to flush for valid text


def test_detokenizer_holds_a_partial_character_until_complete_or_flushed(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) >= 2 and tok.decode(ids[:1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(ids[:1]) == ""
    assert detok.push(ids[1:]) == "😀"
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(ids[:1]) == "" and detok.flush() == tok.decode(ids[:1])  # not dropped at the end
    # A prompt that ends mid-character must not swallow the output's first bytes.
    prompt, output = tok.encode("ab😀", add_special_tokens=False)[:-1], ids[-1:] + tok.encode(" ok", add_special_tokens=False)
    assert "".join(_stream(tok, prompt, output)) == tok.decode(output)


def test_detokenizer_work_per_token_is_bounded(tok):
    class Counting:
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.longest = max(Counting.longest, len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    output = tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    assert len(output) > 1000
    detok = IncrementalDetokenizer(Counting(), list(range(100, 200)))
    text = "".join(detok.push([i]) for i in output) + detok.flush()
    assert text == tok.decode(output) and Counting.longest <= 12


# --- stop strings -------------------------------------------------------------------------------


def _run(checker, deltas):
    out, matched = [], None
    for d in deltas:
        emit, hit = checker.feed(d)
        out.append(emit)
        matched = matched or hit
    out.append(checker.flush())
    return out, matched


def test_stop_split_across_deltas_never_leaks():
    out, matched = _run(StopChecker(["<|user|>"]), ["Hello wor", "ld<|us", "er|> more", "even more"])
    assert out == ["Hello wor", "ld", "", "", ""] and matched == "<|user|>"


def test_stop_include_in_output_and_at_start():
    assert _run(StopChecker(["END"], include_in_output=True), ["abc E", "ND tail"]) == (["abc ", "END", ""], "END")
    assert StopChecker(["STOP"]).feed("STOP right away") == ("", "STOP")


def test_earliest_completed_stop_wins():
    assert StopChecker(["world", "lo"]).feed("Hello world") == ("Hel", "lo")
    assert StopChecker(["bc", "abcd"]).feed("xabcd") == ("xa", "bc")  # "bc" completes first
    assert StopChecker(["ab", "xab"]).feed("xab") == ("", "xab")  # same end: the longer, earlier one


def test_no_false_holds():
    c = StopChecker(["abc", "zz"])
    assert c.feed("xyz") == ("xy", None)  # "z" could start "zz"
    assert c.feed("y") == ("zy", None)
    assert c.feed("xab") == ("x", None) and c.flush() == "ab"
    assert StopChecker([]).feed("anything") == ("anything", None)
    with pytest.raises(ValueError, match="stop"):
        StopChecker([""])


def test_stop_result_does_not_depend_on_delta_boundaries():
    rng = random.Random(1)
    stops = ["ab a", "ca", "bbb", "a\n"]
    for _ in range(500):
        text = "".join(rng.choice("ab c\n") for _ in range(rng.randint(0, 25)))
        whole = _run(StopChecker(stops), [text])
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        split = _run(StopChecker(stops), deltas)
        assert ("".join(split[0]), split[1]) == ("".join(whole[0]), whole[1])
        ends = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
        expected = text[: min(ends)[0] + min(ends)[1]] if ends else text
        assert "".join(whole[0]) == expected and whole[1] == (min(ends)[2] if ends else None)


# --- one sample's text: detokenizer + stop strings over engine deltas -----------------------------


def _delta(ids: list[int], finished: bool = False, reason: str | None = None,
           stop_id: int | None = None) -> EngineOutput:
    return EngineOutput("r", 0, ids, None, finished=finished, finish_reason=reason, matched_stop=stop_id)


def _sample_text(tok, prompt: str, deltas: list[EngineOutput], stop: list[str]) -> tuple[str, str | None]:
    text = SampleText(tok, tok.encode(prompt), SamplingParams(stop=stop, max_tokens=64))
    out = ""
    for d in deltas:
        piece, hit, _ = text.push(d)
        out += piece
        if hit is not None:
            return out, hit  # the caller ends the sample here
    return out, None


def test_stop_string_completed_by_the_finishing_delta(tok):
    """The last delta (max_tokens reached, or the token before EOS arriving with EOS) can complete
    a stop string: it must match there, not leak into the text as the stream is flushed."""
    ids = tok.encode(" The cat sat on the mat. The end")
    text = tok.decode(ids)
    assert text.endswith("The end")
    head = [_delta([t]) for t in ids[:-1]]
    for stop in ("end", "e end", ". The end"):  # inside the last token; across the last two, three
        at_length = head + [_delta(ids[-1:], True, "length")]
        assert _sample_text(tok, "Once", at_length, [stop]) == (text[: -len(stop)], stop)
        eos = tok.eos_token_ids[0]  # a delta may carry several ids (a step that accepts several)
        with_eos = [_delta([t]) for t in ids[:-2]] + [_delta([ids[-2], ids[-1], eos], True, "stop", eos)]
        assert _sample_text(tok, "Once", with_eos, [stop]) == (text[: -len(stop)], stop)
    # and when the stop never completes, the finishing delta flushes what was held back
    never = head + [_delta(ids[-1:], True, "length")]
    assert _sample_text(tok, "Once", never, ["end!"]) == (text, None)


@pytest.mark.parametrize("stop, min_tokens", [(["mat"], 0), (["the"], 0), (["the"], 4), (["dog sat", "log"], 2),
                                              (["never there"], 0)])
def test_a_delta_of_many_ids_stops_where_one_id_a_delta_stops(tok, stop, min_tokens):
    """A delta's ids are checked one by one: the text, the stop string and how many ids are output
    (`kept`) are those of one id per delta, for any grouping (a verify's tokens, joined deltas)."""
    ids = tok.encode(" sat on the mat. the dog sat on the log. the cat")
    params = SamplingParams(stop=stop, min_tokens=min_tokens, max_tokens=64)

    def run(groups: list[list[int]]) -> tuple[str, str | None, int]:
        text, out, used = SampleText(tok, tok.encode("Once"), params), "", 0
        for i, group in enumerate(groups):
            piece, hit, kept = text.push(_delta(group, finished=i == len(groups) - 1, reason="length"))
            out, used = out + piece, used + kept
            if hit is not None:
                return out, hit, used
        return out, None, used

    one_each = run([[t] for t in ids])
    assert one_each[2] < len(ids) if one_each[1] else one_each[2] == len(ids)
    for size in (2, 3, 5, len(ids)):
        assert run([ids[i:i + size] for i in range(0, len(ids), size)]) == one_each, size


@pytest.mark.parametrize("stop, min_tokens, want", [
    ([" 5"], 2, (" 5", 2, "")),  # begun before min_tokens, completed by the min_tokens-th token: it counts
    ([" 5"], 3, (None, 8, " 5, 6, 7")),  # completed before: it does not, and nothing matches later
    ([" 5", "5, 6"], 3, ("5, 6", 5, " ")),  # the later one, completed after, does
    (["5,", " 5"], 3, ("5,", 3, " ")),  # one that ends at the min_tokens-th token counts
])
def test_a_stop_string_counts_when_a_token_from_min_tokens_on_completes_it(tok, stop, min_tokens, want):
    """The tokens " ", "5", ",", " ", "6", ",", " ", "7": a stop string may begin in the text of the
    tokens before min_tokens (held back as context) but counts only if the min_tokens-th token or a
    later one completes it, one id per delta or all at once."""
    ids = tok.encode(" 5, 6, 7")
    assert len(ids) == 8
    params = SamplingParams(stop=stop, min_tokens=min_tokens, max_tokens=64)
    for groups in ([[t] for t in ids], [ids]):
        text, out, used, hit = SampleText(tok, tok.encode("Count:"), params), "", 0, None
        for i, group in enumerate(groups):
            piece, hit, kept = text.push(_delta(group, finished=i == len(groups) - 1, reason="length"))
            out, used = out + piece, used + kept
            if hit is not None:
                break
        assert (hit, used, out) == want, groups
