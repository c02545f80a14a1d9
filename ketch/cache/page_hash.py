"""Chained page hashes: a cached page's name that does not depend on where it lives.

    hash(page i) = sha256(hash(page i-1) ‖ the page's token ids as u32 little-endian)
    hash(page -1) = b"" (the root)

So a hash names a page together with its whole prefix: two pages with the same hash hold the
K/V of the same tokens after the same history. The tiers to come (host memory, storage) and a
cache-aware router key pages by it; the radix tree emits it with every insert and evict.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

ROOT_HASH = b""


def chain_hashes(parent: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The hashes of the whole pages of `tokens`, following the page whose hash is `parent`."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * page_size
    out: list[bytes] = []
    for lo in range(0, len(data) - step + 1, step):
        parent = hashlib.sha256(parent + data[lo : lo + step]).digest()
        out.append(parent)
    return out


class CacheEvents(Protocol):
    """What the prefix cache tells an observer (the KV tiers, a router's view of this replica)."""

    def stored(self, hashes: list[bytes], pages: list[int]) -> None:
        """These pages (named by their chained hashes) entered the cache."""

    def removed(self, hashes: list[bytes], pages: list[int]) -> None:
        """These pages left the cache (evicted): their K/V is no longer served from this tier."""
