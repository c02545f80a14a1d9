"""ketch/text/token_bound.py: the bytes one token can cover, where the tokenizer proves a bound, and
the server's refusal of a prompt whose length alone shows it cannot fit (server/encoding.py)."""
from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest
from transformers import PreTrainedTokenizerFast

from ketch.server.encoding import on_encoder_thread, refuse_unfitting
from ketch.server.errors import APIError
from ketch.text.token_bound import max_bytes_per_token
from ketch.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smollm_path) -> Tokenizer:
    return Tokenizer.load(smollm_path)


def _longest_token_text(tok: Tokenizer) -> str:
    """The text of the token that covers the most bytes: the tightest case for the bound."""
    vocab = tok.hf.get_vocab()
    longest = max(vocab, key=len)  # byte-level: one vocabulary character per byte
    return tok.decode([vocab[longest]], skip_special_tokens=False)


def test_every_text_has_at_least_its_length_over_the_bound_in_tokens(tok):
    per_token = tok.max_bytes_per_token
    assert per_token is not None  # SmolLM2: byte-level BPE, no normalizer
    rng = random.Random(0)
    alphabet = [" ", "\n", "\t", "a", "Z", "é", "ж", "中", "😀", "<|im_end|>", "<|im_start|>", "0", "}"]
    texts = [_longest_token_text(tok) * 50, " " * 5000, "\n" * 3000, "😀" * 700, "<|im_end|>" * 100]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(40)]
    for text in texts:
        assert len(tok.encode(text, add_special_tokens=False)) >= -(-len(text) // per_token), text[:40]


def _variant(tok: Tokenizer, change) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer as RustTokenizer

    spec = json.loads(tok.hf._tokenizer.to_str())
    change(spec)
    return PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(json.dumps(spec)))


def _set(key, value):
    return lambda spec: spec.__setitem__(key, value)


def _lstrip_first_added(spec):
    spec["added_tokens"][0]["lstrip"] = True


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
SPLIT = {"type": "Split", "pattern": {"Regex": "\\s+"}, "invert": False}


@pytest.mark.parametrize("change, bounded", [
    (lambda spec: None, True),
    (_set("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{**SPLIT, "behavior": "Isolated"}, BYTE_LEVEL]}), True),
    (_set("normalizer", {"type": "NFC"}), False),  # composes a letter and its accent: fewer characters
    (_set("normalizer", {"type": "Strip", "strip_left": True, "strip_right": True}), False),  # drops text
    (_set("pre_tokenizer", {"type": "Whitespace"}), False),  # drops whitespace, and no byte level
    (_set("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{**SPLIT, "behavior": "Removed"}, BYTE_LEVEL]}), False),
    (_lstrip_first_added, False),  # an added token that swallows the whitespace before it
], ids=["as-is", "split-isolated", "nfc", "strip", "whitespace", "split-removed", "lstrip"])
def test_a_bound_only_where_the_structure_proves_one(tok, change, bounded):
    assert (max_bytes_per_token(_variant(tok, change)) is not None) is bounded


def test_whitespace_swallowed_by_an_lstrip_token_breaks_a_length_bound(tok):
    """Why lstrip voids the bound: one added token then covers any run of spaces before it."""
    hf = _variant(tok, _lstrip_first_added)
    marker = json.loads(hf._tokenizer.to_str())["added_tokens"][0]["content"]
    text = " " * 2000 + marker
    assert len(hf.encode(text, add_special_tokens=False)) < len(text) // tok.max_bytes_per_token


def test_refusal_starts_where_the_bound_proves_max_model_len_tokens(tok):
    per_token, max_len = tok.max_bytes_per_token, 64
    refuse_unfitting(tok, "x" * (per_token * (max_len - 1)), max_len, "prompt")  # may be max_len - 1 tokens: passes
    text = _longest_token_text(tok) * (per_token * max_len // len(_longest_token_text(tok)) + 1)
    assert len(text) > per_token * (max_len - 1)
    with pytest.raises(APIError) as info:
        refuse_unfitting(tok, text, max_len, "prompt")
    e = info.value
    assert e.status == 400 and e.param == "prompt" and e.code == "context_length_exceeded"
    assert "at least" in e.message and f"context length is {max_len}" in e.message
    assert len(tok.encode(text)) >= max_len  # what tokenizing would have found: the refusal is right
    refuse_unfitting(tok, text, None, "prompt")  # no context known: nothing refused


def test_encoding_runs_while_the_loop_serves_others():
    """encode() waits for an event that only a coroutine on the loop sets: it returns True only if
    the loop ran that coroutine meanwhile (run on the loop, it would block it and time out)."""
    released = threading.Event()

    async def scenario() -> bool:
        async def other_client() -> None:
            released.set()

        task = asyncio.ensure_future(other_client())
        ran = await on_encoder_thread(lambda: released.wait(30.0))
        await task
        return ran

    assert asyncio.run(scenario()) is True
