"""Incremental detokenization: turn a stream of token ids into a stream of text deltas.

Decoding token by token is wrong (byte-level BPE splits one character over several tokens;
SentencePiece drops a word's leading space when it is decoded alone), and decoding the whole
output every step is O(n) per token. We keep a small window over the id list:

    ids:   ... | prefix_offset ........ read_offset ........ end
                 '--- already emitted ---'   '--- pending ---'

Each push decodes ids[prefix_offset:] and ids[prefix_offset:read_offset]; the difference is the new
text. It is emitted only up to the last id after which the decoded tail is not U+FFFD (an
incomplete UTF-8 sequence is waiting for its next bytes); then the window slides forward.
read_offset therefore always sits on a character boundary, which is what makes the emitted pieces
add up to decode(all ids), and the text emitted after any id is the same however the ids were
grouped into pushes.

The window starts on the last few prompt tokens so the first output token decodes in context
(its leading space survives), unless the prompt ends mid-character: then it starts empty.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5
_MAX_SCAN_BACK = 8  # ids looked back past a partial character (>= 4 bytes' worth: one id >= one byte)
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
        end = len(self._ids)
        full = self._decode(self._ids[self._prefix_offset :])
        if full.endswith(_REPLACEMENT) and not final:
            # Emit up to the last id after which the text is whole, as pushing the ids one at a
            # time would have: what is emitted then never depends on how the ids were grouped
            # (coalesced deltas, or a resumed stream's outputs pushed at once, SampleText).
            end, full = self._last_whole(prefix)
        if len(full) <= len(prefix):
            return ""
        # Drop ids before the window for good: callers only ever see text, never offsets.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, end - self._read_offset
        return full[len(prefix) :]

    def _last_whole(self, prefix: str) -> tuple[int, str]:
        """(end, decoded window up to it) for the last end among the newest ids where the text
        does not end in a partial character; (read_offset, prefix) if none. A character has at
        most 4 bytes, so a few ids back suffice unless the bytes are invalid, which we then hold."""
        for end in range(len(self._ids) - 1, max(self._read_offset, len(self._ids) - _MAX_SCAN_BACK - 1), -1):
            text = self._decode(self._ids[self._prefix_offset : end])
            if not text.endswith(_REPLACEMENT) and len(text) > len(prefix):
                return end, text
        return self._read_offset, prefix
