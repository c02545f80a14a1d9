"""Logprobs of tokens that hold only part of a character (ketch/text/token_bytes.py,
ketch/server/logprobs.py): chat's `bytes` are the token's own bytes, so a client can join them back
into the emoji or CJK character; completions' token strings and top_logprobs keys stay distinct
("bytes:\\xf0\\x9f"), and the sampled token is always among completions' top_logprobs."""
from __future__ import annotations

import pytest

from ketch.engine.messages import WireLogprob
from ketch.server.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from ketch.text.token_bytes import BYTE_OF_CHAR, display, token_bytes
from ketch.text.tokenizer import Tokenizer

TEXT = "🎉 emoji 你好 café"


@pytest.fixture(scope="module")
def tok(smollm_path) -> Tokenizer:
    return Tokenizer.load(smollm_path)


def test_the_byte_table_covers_every_byte_once():
    assert len(BYTE_OF_CHAR) == 256 and sorted(BYTE_OF_CHAR.values()) == list(range(256))
    assert BYTE_OF_CHAR["Ġ"] == 0x20 and BYTE_OF_CHAR["A"] == 0x41  # GPT-2's space, a printable byte


def test_the_tokens_bytes_join_into_the_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case at hand: tokens inside a character
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == TEXT


def test_chat_bytes_and_tokens(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    content = chat_logprobs(tok, [WireLogprob(i, -0.5, [(i, -0.5)]) for i in ids])["content"]
    assert bytes(b for c in content for b in c["bytes"]).decode() == TEXT
    partial = [c for c in content if "\ufffd" in tok.decode([ids[content.index(c)]])]
    assert partial and all(c["token"].startswith("bytes:\\x") for c in partial)
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)


def test_completion_keys_stay_distinct_and_hold_the_sampled_token(tok):
    ids = tok.encode("🎉🐍", add_special_tokens=False)
    partial = list(dict.fromkeys(i for i in ids if "\ufffd" in tok.decode([i])))  # distinct ids, in order
    assert len(partial) >= 3
    sampled, *others = partial
    lp = WireLogprob(sampled, -3.0, [(t, -0.1 * n) for n, t in enumerate(others)])  # sampled outside the top
    out = completion_logprobs(tok, [lp], TextOffsets(tok))
    top = out["top_logprobs"][0]
    assert len(top) == len(others) + 1  # every alternative its own key, plus the sampled one
    assert top[out["tokens"][0]] == -3.0 and out["tokens"][0] == display(tok.token_bytes(sampled))
    inside = WireLogprob(sampled, -0.2, [(sampled, -0.2), (others[0], -1.0)])
    assert completion_logprobs(tok, [inside], TextOffsets(tok))["top_logprobs"][0] == {
        display(tok.token_bytes(sampled)): -0.2, display(tok.token_bytes(others[0])): -1.0}


def test_text_offsets_index_the_text(tok):
    """Each token's text_offset is the index of the character its first byte starts or continues:
    a character split over three tokens is counted once, not once per piece."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    lps = [WireLogprob(i, -0.5, []) for i in ids]
    whole = completion_logprobs(tok, lps, TextOffsets(tok))["text_offset"]
    raw, expected = TEXT.encode(), []
    for i in ids:  # the complete characters before the token's first byte
        expected.append(len(raw[:sum(len(tok.token_bytes(t)) for t in ids[:len(expected)])].decode(errors="ignore")))
    assert whole == expected and len(set(whole)) < len(whole)  # some tokens share a character
    assert all(TEXT[o:].encode().startswith(tok.token_bytes(i)) for o, i in zip(whole, ids)
               if "\ufffd" not in tok.decode([i]))
    # in pieces, after a resumed stream's first tokens: the same offsets
    offsets = TextOffsets(tok, ids[:3])
    pieces = [completion_logprobs(tok, lps[k:k + 2], offsets)["text_offset"] for k in range(3, len(ids), 2)]
    assert [o for p in pieces for o in p] == whole[3:]


def test_byte_fallback_vocabularies():
    """SentencePiece's byte fallback: an entry "<0xF0>" is that one byte."""
    class Vocab:  # a tokenizer's two answers for one id, as a SentencePiece model gives them
        def decode(self, ids, skip_special_tokens=False):
            return "\ufffd"

        def convert_ids_to_tokens(self, ids):
            return ["<0xF0>"]

    assert token_bytes(Vocab(), 7) == b"\xf0"
    assert display(b"\xf0\x9f") == "bytes:\\xf0\\x9f" and display("é".encode()) == "é"
