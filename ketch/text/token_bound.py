"""How many bytes of text one token can cover at most, where the tokenizer's structure proves a bound.

A prompt's token count is then at least its length over that bound, without tokenizing it: a text
whose length alone proves it cannot fit the context is refused before any tokenizer work (the
server, ketch/server/encoding.py; a 30 MB prompt took over a minute to tokenize, for a 400).

The bound holds for a byte-level BPE with no normalizer (GPT-2, Llama 3, Qwen, SmolLM2): every
byte of the text maps to one character of the model's alphabet, no byte is dropped, and a token's
vocabulary string (its UTF-8 length) spells at least the bytes it covers. The text's length in
characters is at most its length in bytes, so tokens >= ceil(characters / bound). Anything that
can make one token cover an unbounded stretch, or drop text, voids it, and then there is no
bound (None): a normalizer (NFC composes a letter and its accent into one character, BERT's
removes control characters, a Strip drops whitespace), a pre-tokenizer that removes what it splits on (Whitespace, a Split `removed`), an
unknown-token model without byte-level input (a fused `<unk>`, WordPiece's whole-word [UNK]), an
added token that strips the whitespace beside it (lstrip / rstrip).
"""
from __future__ import annotations

import json
from typing import Any

# pre-tokenizers that keep every character: ByteLevel maps each byte to one, Digits and a Split
# that isolates or merges its matches only cut the text into pieces
_KEEPING = {"ByteLevel", "Digits"}
_SPLIT_KEEPS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


def _pieces(pre_tokenizer: dict[str, Any] | None) -> list[dict[str, Any]]:
    if pre_tokenizer is None:
        return []
    if pre_tokenizer.get("type") == "Sequence":
        return [p for item in pre_tokenizer.get("pretokenizers", []) for p in _pieces(item)]
    return [pre_tokenizer]


def _keeps_every_byte(pre_tokenizer: dict[str, Any] | None) -> bool:
    pieces = _pieces(pre_tokenizer)
    keeps = all(p.get("type") in _KEEPING or (p.get("type") == "Split" and p.get("behavior") in _SPLIT_KEEPS)
                for p in pieces)
    return keeps and any(p.get("type") == "ByteLevel" for p in pieces)  # byte-level: no unknown token


def max_bytes_per_token(hf_tokenizer: Any) -> int | None:
    """The most bytes of input one token covers, or None where no bound is proven (above)."""
    backend = getattr(hf_tokenizer, "_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
        return None
    if not _keeps_every_byte(spec.get("pre_tokenizer")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    return max(len(piece.encode("utf-8")) for piece in hf_tokenizer.get_vocab())
