"""Cache-aware routing: send a request where its prefix was sent before, unless that would pile
work onto a busy worker.

    loads imbalanced?  (max - min > balance_abs_threshold  and  max > balance_rel_threshold × min)
      yes ─▶ the least loaded worker                                   (reason "balance")
      no  ─▶ best prefix match over the text ≥ cache_threshold (and > 0 characters)?
               yes ─▶ that worker                                      (reason "cache_hit")
               no  ─▶ the worker with the smallest tree: the most room  (reason "smallest_tree")
    then the text goes into the chosen worker's tree (and out again if the worker refuses the
    request: a 400 for a prompt too long cached nothing there).

One approximate radix tree per worker (radix.py) over the routed text (routed.py); trees are cut
back to --max-tree-size characters, least recently used first, by `maintain` (every
--eviction-interval-secs), and dropped when their worker leaves. Ties go to the less loaded
worker, then the smaller tree, then the order the workers joined.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ketch.gateway.config import CacheAwareConfig
from ketch.gateway.policies.base import Choice, RoutingPolicy
from ketch.gateway.radix import RadixTree
from ketch.gateway.routed import RoutedRequest
from ketch.gateway.worker import Worker


class CacheAware(RoutingPolicy):
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig) -> None:
        self.config = config
        self._trees: dict[str, RadixTree] = {}

    def _tree(self, url: str) -> RadixTree:
        tree = self._trees.get(url)
        if tree is None:
            tree = self._trees[url] = RadixTree()
        return tree

    def imbalanced(self, workers: Sequence[Worker]) -> bool:
        loads = [w.load for w in workers]
        low, high = min(loads), max(loads)
        return high - low > self.config.balance_abs_threshold and high > self.config.balance_rel_threshold * low

    def pick(self, request: RoutedRequest, workers: Sequence[Worker]) -> Choice:
        text = request.text
        if self.imbalanced(workers):
            worker = min(workers, key=lambda w: (w.load, self._tree(w.url).size))
            choice = Choice(worker, "balance")
        else:
            matched = {w.url: self._tree(w.url).match(text) for w in workers}
            best = max(workers, key=lambda w: (matched[w.url], -w.load, -self._tree(w.url).size))
            ratio = matched[best.url] / len(text) if text else 0.0
            if matched[best.url] > 0 and ratio >= self.config.cache_threshold:
                choice = Choice(best, "cache_hit", ratio)
            else:
                worker = min(workers, key=lambda w: (self._tree(w.url).size, w.load))
                choice = Choice(worker, "smallest_tree", ratio)
        tree = self._tree(choice.worker.url)
        added = tree.insert(text)
        return replace(choice, unlearn=lambda: tree.take_back(added))

    def forget(self, url: str) -> None:
        self._trees.pop(url, None)

    def maintain(self) -> None:
        for tree in self._trees.values():
            tree.evict(self.config.max_tree_size)

    def tree_sizes(self) -> dict[str, int]:
        return {url: tree.size for url, tree in self._trees.items()}
