"""Engine logprobs → the two OpenAI shapes (chat's `content` list, completions' parallel lists).

A token that holds only part of a character (an emoji or CJK character split over tokens) has
its real bytes in chat's `bytes` (token_bytes.py) and shows as "bytes:\\xf0\\x9f" in `token` and
in completions' tokens / top_logprobs keys, so distinct tokens never share a key. Completions'
top_logprobs always hold the sampled token too (up to logprobs + 1 entries, as OpenAI's).

Completions' `text_offset` is each token's character index in the choice's text. It is counted
over the tokens' bytes through an incremental UTF-8 decoder, so a character split over tokens
counts once (every token of it starts at that character); counting each token decoded alone
counted a U+FFFD for every piece."""
from __future__ import annotations

import codecs
from collections.abc import Sequence

from ketch.engine.messages import WireLogprob
from ketch.text.token_bytes import display
from ketch.text.tokenizer import Tokenizer


def _raw(tok: Tokenizer | None, token_id: int) -> bytes:
    return tok.token_bytes(token_id) if tok else str(token_id).encode()


def chat_logprobs(tok: Tokenizer | None, lps: list[WireLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        raw = _raw(tok, token_id)
        return {"token": display(raw), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, l) for t, l in lp.top]}
                        for lp in lps]}


class TextOffsets:
    """The running character count of one choice's text, token by token."""

    def __init__(self, tok: Tokenizer | None, before: Sequence[int] = ()) -> None:
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0
        for token_id in before:  # a resumed stream's offsets go on from the original's
            self.advance(token_id)

    def advance(self, token_id: int) -> int:
        """The token's offset; counts the characters it completes."""
        at = self.chars
        self.chars += len(self._utf8.decode(_raw(self._tok, token_id)))
        return at


def completion_logprobs(tok: Tokenizer | None, lps: list[WireLogprob], offsets: TextOffsets) -> dict:
    tokens, top = [], []
    for lp in lps:
        token = display(_raw(tok, lp.token_id))
        alternatives = {display(_raw(tok, t)): l for t, l in lp.top}
        alternatives.setdefault(token, lp.logprob)  # the sampled token, always
        tokens.append(token)
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
            "text_offset": [offsets.advance(lp.token_id) for lp in lps]}
