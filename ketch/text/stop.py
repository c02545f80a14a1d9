"""Stop strings over a stream of text deltas.

A stop string may arrive split across deltas ("<|us" + "er|>"), so text that could still be the
start of a stop string is held back until the next delta decides it. Held text is only ever a
suffix that is a proper prefix of some stop string, so nothing is held without reason and at most
max(len(stop)) - 1 characters wait.

The match that wins is the one that *completes* first in the stream (then the longer one, if two
end together), so the result never depends on how the text happened to be split into deltas.
"""
from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop: stop strings must be non-empty strings")
        self.stop = tuple(dict.fromkeys(stop))
        self.include_in_output = include_in_output
        self._held = ""
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self.matched: str | None = None

    def feed(self, delta: str, match: bool = True) -> tuple[str, str | None]:
        """Feed new text; return (text safe to emit now, the stop string matched or None).

        `match=False`: the text is context only (a sample's tokens before min_tokens): nothing in it
        matches, but what could start a stop string is held, so a stop string that a later delta
        completes is caught even if it began here. A match must end inside the delta fed with
        `match=True` that completes it.

        After a match the checker is finished: later calls return ("", None).
        """
        if self.matched is not None:
            return "", None
        text = self._held + delta
        hit = self._first_match(text, len(self._held) + 1) if match and delta else None
        if hit is not None:
            start, stop = hit
            self.matched, self._held = stop, ""
            return text[: start + len(stop)] if self.include_in_output else text[:start], stop
        keep = self._hold_length(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """End of stream: release what was held (it did not turn into a stop string)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str, min_end: int) -> tuple[int, str] | None:
        """The match that ends first at or after `min_end` (then the longer one)."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for s in self.stop:
            i = text.find(s, max(0, min_end - len(s)))
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        return None if best is None else (best[0] - len(best[2]), best[2])

    def _hold_length(self, text: str) -> int:
        # Longest suffix of `text` that some stop string starts with (shorter ones are inside it).
        for k in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
