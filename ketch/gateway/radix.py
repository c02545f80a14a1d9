"""An approximate radix tree over request text: what one worker has probably cached.

Approximate, because the gateway only sees the text it routed there, not the worker's own
cache: the worker may have evicted a prefix the tree still holds, and the text is not the
tokenized prompt. Good enough to send a shared prefix back where it was computed.

    root ── "system\\nYou are a pirate.\\nuser\\n" ──┬── "Hi\\n"
                                                    └── "Where is the gold?\\n"

Edges are strings; a node's children are keyed by their edge's first character. `size` is the
number of characters on all edges: the bound `--max-tree-size` applies to it. Every insert stamps
the nodes on its path with a fresh tick, so a node is never older than a descendant and removing
the oldest leaves first is LRU eviction. Each node counts the inserts through it, so that one can
be taken back (`take_back`: its worker refused the request) without taking what others hold.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass


class _Node:
    __slots__ = ("edge", "children", "parent", "tick", "born", "holders")

    def __init__(self, edge: str, parent: _Node | None, tick: int, born: int, holders: int) -> None:
        self.edge = edge
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.tick = tick  # the last insert through it (LRU)
        self.born = born  # the insert that first added its characters (a split's parts keep it)
        self.holders = holders  # inserts through it not taken back (every one covers the whole edge)


def _common_length(edge: str, text: str, start: int) -> int:
    """How many leading characters of `edge` equal text[start:...] (slice compares, not a
    Python loop per character: prompts run to hundreds of thousands of characters)."""
    n = min(len(edge), len(text) - start)
    if text.startswith(edge[:n], start):
        return n
    lo, hi = 0, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Added:
    """One insert, for `take_back`: its text and tick."""
    text: str
    tick: int


class RadixTree:
    def __init__(self) -> None:
        self._root = _Node("", None, 0, 0, 0)
        self._ticks = itertools.count(1)
        self.size = 0

    def match(self, text: str) -> int:
        """Length of the longest prefix of `text` in the tree (reading does not count as use)."""
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            common = _common_length(child.edge, text, i)
            i += common
            if common < len(child.edge):
                break
            node = child
        return i

    def insert(self, text: str) -> Added:
        """Returns the insert, for `take_back`."""
        tick = next(self._ticks)
        node, i = self._root, 0
        node.tick = tick
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, tick, tick, 1)
                node.children[text[i]] = leaf
                self.size += len(leaf.edge)
                break
            common = _common_length(child.edge, text, i)
            if common < len(child.edge):  # split the edge where the texts part (or this one ends)
                middle = _Node(child.edge[:common], node, tick, child.born, child.holders)
                child.edge = child.edge[common:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                node.children[text[i]] = middle
                child = middle
            child.tick = tick
            child.holders += 1
            node, i = child, i + common
        return Added(text, tick)

    def take_back(self, added: Added) -> int:
        """Undoes an insert (a worker refused the request: it cached none of it): the characters
        no other insert holds leave the tree. Nodes evicted since are skipped, and so is anything
        made after the insert (its text evicted, then inserted again by another). Returns the
        characters removed."""
        path, node, i, text = [], self._root, 0, added.text
        while i < len(text):
            child = node.children.get(text[i])
            if child is None or child.born > added.tick or not text.startswith(child.edge, i):
                break
            path.append(child)
            node, i = child, i + len(child.edge)
        for node in path:
            node.holders -= 1
        gone = next((n for n in path if n.holders <= 0), None)
        if gone is None:
            return 0
        del gone.parent.children[gone.edge[0]]
        removed = sum(len(n.edge) for n in _subtree(gone))
        self.size -= removed
        return removed

    def evict(self, max_size: int) -> int:
        """Drop least recently used leaves until `size <= max_size`; returns the characters freed."""
        if self.size <= max_size:
            return 0
        before = self.size
        order = itertools.count()  # ties on tick: any order, but heapq must never compare nodes
        leaves = [(n.tick, next(order), n) for n in self._nodes() if not n.children and n is not self._root]
        heapq.heapify(leaves)
        while self.size > max_size and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if not parent.children and parent is not self._root:
                heapq.heappush(leaves, (parent.tick, next(order), parent))
        return before - self.size

    def _nodes(self) -> list[_Node]:
        return _subtree(self._root)


def _subtree(top: _Node) -> list[_Node]:
    out, stack = [], [top]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out
