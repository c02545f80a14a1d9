"""The radix tree's node and the small records its operations return."""
from __future__ import annotations

from dataclasses import dataclass


class Node:
    __slots__ = ("id", "key", "pages", "host", "hashes", "parent", "children", "lock_ref", "last_access", "start")

    def __init__(self, nid: int, key: tuple[int, ...], pages: list[int], hashes: list[bytes],
                 parent: Node | None, start: int, last_access: int) -> None:
        self.id = nid
        self.key = key  # tokens on the edge from parent to this node
        self.pages = pages  # one device page id per page_size tokens of key; [] when only on the host
        self.host: list[int] = []  # host page ids of the same tokens (hierarchical cache), or []
        self.hashes = hashes  # the chained hash of each of those pages (cache/page_hash.py)
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = last_access  # LRU clock tick; parent's is always >= child's
        self.start = start  # tokens on the path above this edge

    @property
    def last_hash(self) -> bytes:
        """The hash its children chain from (the root's is empty)."""
        return self.hashes[-1] if self.hashes else b""

    @property
    def on_device(self) -> bool:
        return bool(self.pages)

    @property
    def on_host(self) -> bool:
        return bool(self.host)

    @property
    def tier(self) -> str:
        """Where its pages are: "device", "host" or "both" (cache/hiradix.py)."""
        return "both" if self.pages and self.host else ("device" if self.pages else "host")

    @property
    def end(self) -> int:
        """Prefix length (tokens from the root) this node covers."""
        return self.start + len(self.key)

    def short_key(self) -> str:
        return " ".join(map(str, self.key[:8])) + (" …" if len(self.key) > 8 else "")

    def __repr__(self) -> str:
        return (f"Node#{self.id}([{self.short_key()}] tokens {self.start}:{self.end}, "
                f"pages={self.pages}{f', host={self.host}' if self.host else ''}, lock={self.lock_ref}, t={self.last_access}, "
                f"children={len(self.children)})")


@dataclass(slots=True)
class MatchResult:
    pages: list[int]  # tree pages covering tokens[:length]; the caller increfs them if used
    length: int  # matched tokens, a multiple of page_size
    node: Node  # deepest node; covers exactly `length` tokens (root when length == 0)
    host_len: int = 0  # trailing tokens of the hit only on the host (pages covers the rest)


@dataclass(slots=True)
class InsertResult:
    node: Node  # deepest node, covering exactly all inserted tokens
    new_pages: int  # caller pages the tree took a reference on
    prefix_len: int  # leading tokens already present (their caller pages were NOT taken)


@dataclass(slots=True)
class CacheStats:
    match_queries: int = 0
    query_tokens: int = 0
    matched_tokens: int = 0
    inserted_pages: int = 0
    evicted_pages: int = 0
    splits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.query_tokens if self.query_tokens else 0.0
