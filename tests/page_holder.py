"""A page holder for cache tests: the fields the KV manager reads and writes (the scheduler's
Request has these among others)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ketch.cache.radix_node import Node


@dataclass(eq=False)
class Holder:
    ids: list[int]
    page_table: list[int] = field(default_factory=list)
    cache_node: Node | None = None
    num_computed: int = 0
    num_inserted_pages: int = 0

    @property
    def num_resolved(self) -> int:
        return len(self.ids)

    def tokens(self, lo: int, hi: int) -> list[int]:
        return self.ids[lo:hi]
