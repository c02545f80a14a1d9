"""The L3 storage interface: a flat key -> bytes store that the KV tiers write pages into.

A backend may be a local directory, Redis, or a distributed store; all the engine needs is
`get`, `set`, `exists`, and `exists_prefix`, which counts the *leading* keys present: a store
that evicts on its own (an LRU Redis) can drop the middle of a prefix, and a page after a hole
is useless (its K/V attends to the missing one), so only the unbroken run counts.

Nothing here raises into the engine on an I/O failure: a storage tier is a cache, so a failed
write is dropped and counted, a failed read is a miss. A malformed key is a bug in the caller
and raises ValueError.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# Keys become file names and Redis keys: a conservative alphabet, no path separators, no
# leading dot (the file backend's temp files start with one).
_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


@runtime_checkable
class StorageBackend(Protocol):
    stats: "StorageStats"  # its counters (the engine's /metrics reads them)

    def get(self, key: str) -> bytes | None:
        """The value stored under `key`, or None (missing, or unreadable: counted)."""

    def set(self, key: str, value: bytes) -> bool:
        """Store `value`; False when the write was dropped (counted), never an exception."""

    def exists(self, key: str) -> bool:
        """Whether `key` is stored now (it may be gone by the time it is read)."""

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are stored without a gap."""


@dataclass
class StorageStats:
    """Counters of one backend (mutable: the backend adds to them as it goes)."""

    gets: int = 0
    hits: int = 0
    read_bytes: int = 0
    sets: int = 0
    written_bytes: int = 0
    dropped_writes: int = 0  # a set that returned False: full disk, permissions, ...
    read_errors: int = 0  # a get that failed for another reason than a missing key
    errors: int = 0  # a request to a storage server that failed (refused, timed out, an error reply)
    stale_temps_removed: int = 0  # file backend: temp files of dead writers swept away

    def count_get(self, answer: "bytes | None | Failed") -> bytes | None:
        """A get's answer from a store's server, counted: a failed request (None after it), a
        missing key, or a hit of len(answer) bytes."""
        self.gets += 1
        if isinstance(answer, Failed):
            self.read_errors += 1
            return None
        if answer is not None:
            self.hits += 1
            self.read_bytes += len(answer)
        return answer


class Failed:
    """What a server-backed store's request returns instead of raising (None is a real answer:
    a missing key)."""


FAILED = Failed()


def check_key(key: str) -> str:
    """`key` if it is a valid storage key, else ValueError naming it."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"key: storage keys are 1-200 characters of [A-Za-z0-9._-], not starting "
                         f"with '.', got {key!r}")
    return key
