"""Incremental detokenization: turn a stream of token ids into a stream of text deltas.

Decoding token by token is wrong (byte-level BPE splits one character over several tokens;
SentencePiece drops a word's leading space when it is decoded alone), and decoding the whole
output every step is O(n) per token. We keep a small window over the id list:

    ids:   ... | prefix_offset ........ read_offset ........ end
                 '--- already emitted ---'   '--- pending ---'

Each push decodes ids[prefix_offset:] and ids[prefix_offset:read_offset]; the difference is the new
text. It is emitted only when the decoded tail is not U+FFFD (an incomplete UTF-8 sequence is
waiting for its next bytes); then the window slides forward. read_offset therefore always sits on
a character boundary, which is what makes the emitted pieces add up to decode(all ids).

The window starts on the last few prompt tokens so the first output token decodes in context
(its leading space survives), unless the prompt ends mid-character: then it starts empty.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # a dangling partial character would merge with the output's bytes
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete (possibly "")."""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back, decoded as is."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        # Drop ids before the window for good: callers only ever see text, never offsets.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return full[len(prefix) :]
