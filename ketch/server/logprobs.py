"""Engine logprobs → the two OpenAI shapes (chat's `content` list, completions' parallel lists).

A token that holds only part of a character (an emoji or CJK character split over tokens) has
its real bytes in chat's `bytes` (token_bytes.py) and shows as "bytes:\\xf0\\x9f" in `token` and
in completions' tokens / top_logprobs keys, so distinct tokens never share a key. Completions'
top_logprobs always hold the sampled token too (up to logprobs + 1 entries, as OpenAI's)."""
from __future__ import annotations

from ketch.engine.messages import WireLogprob
from ketch.text.token_bytes import display
from ketch.text.tokenizer import Tokenizer


def _raw(tok: Tokenizer | None, token_id: int) -> bytes:
    return tok.token_bytes(token_id) if tok else str(token_id).encode()


def _text(tok: Tokenizer | None, token_id: int) -> str:
    """The token decoded alone: what text_offset counts."""
    return tok.decode([token_id], skip_special_tokens=False) if tok else str(token_id)


def chat_logprobs(tok: Tokenizer | None, lps: list[WireLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        raw = _raw(tok, token_id)
        return {"token": display(raw), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, l) for t, l in lp.top]}
                        for lp in lps]}


def completion_logprobs(tok: Tokenizer | None, lps: list[WireLogprob], offset: int) -> dict:
    tokens, top, offsets = [], [], []
    for lp in lps:
        token = display(_raw(tok, lp.token_id))
        alternatives = {display(_raw(tok, t)): l for t, l in lp.top}
        alternatives.setdefault(token, lp.logprob)  # the sampled token, always
        tokens.append(token)
        top.append(alternatives)
        offsets.append(offset)
        offset += len(_text(tok, lp.token_id))
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
            "text_offset": offsets}


def text_offset_after(tok: Tokenizer | None, token_ids: list[int]) -> int:
    """The text_offset that follows `token_ids` (a resumed stream's first): offsets add up the
    tokens' own texts, as completion_logprobs counts them."""
    return sum(len(_text(tok, t)) for t in token_ids)
