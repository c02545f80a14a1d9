"""A token's own bytes: what OpenAI's logprobs `bytes` field carries, so that a client can join the
bytes of tokens that each hold part of one character (an emoji, a CJK character) back into it.

Decoding one token of such a character alone gives U+FFFD, whose three bytes say nothing about
the token. Its real bytes come from the vocabulary entry instead:
  * byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen): each character of the entry stands for one
    byte through the GPT-2 byte <-> printable-character table (bytes 33-126, 161-172 and 174-255
    are their own characters; the other 68, in order, are characters 256..323);
  * SentencePiece byte fallback (Llama 2, Mistral): entries "<0xE2>" are one byte each.
Tokens that decode cleanly keep their decoded text's UTF-8 (the same bytes, spaces resolved).
"""
from __future__ import annotations

import re
from typing import Protocol

_SELF = [*range(33, 127), *range(161, 173), *range(174, 256)]
# the GPT-2 table, inverted: printable character -> the byte it stands for
BYTE_OF_CHAR: dict[str, int] = {chr(b): b for b in _SELF}
BYTE_OF_CHAR.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in set(_SELF))})
_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _Decodes(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...
    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...


def token_bytes(tok: _Decodes, token_id: int) -> bytes:
    text = tok.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text.encode()
    piece = tok.convert_ids_to_tokens([token_id])[0] or ""
    if m := _FALLBACK.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    if piece and all(c in BYTE_OF_CHAR for c in piece):
        return bytes(BYTE_OF_CHAR[c] for c in piece)
    return text.encode()  # a real U+FFFD, or a vocabulary this does not know


def display(raw: bytes) -> str:
    """The token as text, or "bytes:\\xe2\\x80" (escaped) when its bytes are not whole UTF-8
    characters: distinct tokens stay distinct as completions' top_logprobs keys."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
