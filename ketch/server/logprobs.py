"""Engine logprobs → the two OpenAI shapes (chat's `content` list, completions' parallel lists)."""
from __future__ import annotations

from ketch.engine.messages import WireLogprob
from ketch.text.tokenizer import Tokenizer


def _token(tok: Tokenizer | None, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False) if tok else str(token_id)


def chat_logprobs(tok: Tokenizer | None, lps: list[WireLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = _token(tok, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, l) for t, l in lp.top]}
                        for lp in lps]}


def completion_logprobs(tok: Tokenizer | None, lps: list[WireLogprob], offset: int) -> dict:
    tokens = [_token(tok, lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token(tok, t): l for t, l in lp.top} for lp in lps], "text_offset": offsets}


def text_offset_after(tok: Tokenizer | None, token_ids: list[int]) -> int:
    """The text_offset that follows `token_ids` (a resumed stream's first): offsets add up the
    tokens' own texts, as completion_logprobs counts them."""
    return sum(len(_token(tok, t)) for t in token_ids)
