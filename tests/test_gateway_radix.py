"""The gateway's approximate radix tree (ketch/gateway/radix.py): prefix matches, size, LRU
eviction, checked against a brute-force reference on random texts."""
from __future__ import annotations

import os
import random

from ketch.gateway.radix import RadixTree


def common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def test_matches_the_longest_prefix_across_split_edges():
    tree = RadixTree()
    assert tree.match("anything") == 0
    tree.insert("hello world")
    assert tree.match("hello there") == len("hello ")
    assert tree.match("hello world, again") == len("hello world")
    assert tree.match("hell") == 4 and tree.match("") == 0 and tree.match("x") == 0
    tree.insert("hello there")  # splits the edge after "hello "
    assert tree.match("hello world") == 11 and tree.match("hello there!") == 11
    assert tree.size == len("hello world") + len("there")


def test_random_texts_against_a_reference():
    rng = random.Random(7)
    tree, inserted = RadixTree(), []
    for _ in range(300):
        # a small alphabet and shared stems: many splits, edges ending mid-text, repeated texts
        stem = rng.choice(["", "sys: be brief\n", "sys: be brief\nuser: ", "abc"])
        text = stem + "".join(rng.choice("abc\n") for _ in range(rng.randint(0, 12)))
        if rng.random() < 0.5:
            tree.insert(text)
            inserted.append(text)
        probe = stem + "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        assert tree.match(probe) == max((common_prefix(probe, s) for s in inserted), default=0)
    # a character trie has one node per distinct non-empty prefix: the tree's characters, exactly
    assert tree.size == len({s[:i] for s in inserted for i in range(1, len(s) + 1)})


def test_a_long_text_diverging_deep_inside_an_edge():
    tree = RadixTree()
    base = "".join(random.Random(1).choice("abcdefgh") for _ in range(200_000))
    tree.insert(base)
    probe = base[:123_457] + ("x" if base[123_457] != "x" else "y") + base[123_458:]
    assert tree.match(probe) == 123_457
    assert tree.match(base + "tail") == len(base)


def test_eviction_removes_least_recently_used_leaves_and_keeps_shared_prefixes():
    tree = RadixTree()
    shared = "system prompt shared by all\n"
    for q in ("first question", "second question", "third question"):
        tree.insert(shared + q)
    tree.insert(shared + "first question")  # used again: the second is now the oldest
    size = tree.size
    freed = tree.evict(size - 1)  # one leaf is enough: the oldest, the second's own tail
    assert freed == len("second question") and tree.size == size - freed
    assert tree.match(shared + "second question") == len(shared)
    assert tree.match(shared + "first question") == len(shared + "first question")
    assert tree.match(shared + "third question") == len(shared + "third question")


def test_eviction_to_zero_and_a_bound_already_met():
    tree = RadixTree()
    tree.insert("abc")
    tree.insert("abd")
    assert tree.evict(10) == 0 and tree.size == 4
    assert tree.evict(0) == 4
    assert tree.size == 0 and tree.match("abc") == 0
    tree.insert("abc")  # a tree emptied by eviction works as new
    assert tree.match("abcd") == 3 and tree.size == 3


def test_eviction_order_follows_use_not_insertion():
    tree = RadixTree()
    tree.insert("aaaa")
    tree.insert("bbbb")
    tree.insert("cccc")
    tree.insert("aaaa")  # oldest is now bbbb
    tree.evict(8)
    assert tree.match("bbbb") == 0 and tree.match("aaaa") == 4 and tree.match("cccc") == 4


def test_take_back_removes_what_no_other_insert_holds():
    tree = RadixTree()
    tree.insert("sys: be brief\nuser: hi")
    refused = tree.insert("sys: be brief\nuser: a prompt the worker refused")
    assert tree.take_back(refused) == len("a prompt the worker refused") and tree.size == len("sys: be brief\nuser: hi")
    assert tree.match("sys: be brief\nuser: a prompt") == len("sys: be brief\nuser: ")
    twice = [tree.insert("x" * 50), tree.insert("x" * 50)]  # the same refused prompt, two at once
    assert tree.take_back(twice[0]) == 0 and tree.take_back(twice[1]) == 50  # the last one out takes it
    gone = tree.insert("zzz")
    tree.evict(0)
    assert tree.take_back(gone) == 0 and tree.size == 0
    again = tree.insert("zzz")  # evicted, then routed there again by another request: not the old one's
    assert tree.take_back(gone) == 0 and tree.match("zzz") == 3
    assert tree.take_back(again) == 3 and tree.size == 0


def test_take_back_against_a_reference():
    """Random inserts and take-backs (no eviction): the tree holds exactly the texts not taken back."""
    rng = random.Random(11)
    tree, held = RadixTree(), []
    for _ in range(500):
        if held and rng.random() < 0.4:
            tree.take_back(held.pop(rng.randrange(len(held)))[1])
        else:
            text = rng.choice(["", "ab", "abc\n", "b"]) + "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 8)))
            held.append((text, tree.insert(text)))
        probe = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 12)))
        assert tree.match(probe) == max((common_prefix(probe, t) for t, _ in held), default=0)
        assert tree.size == len({t[:i] for t, _ in held for i in range(1, len(t) + 1)})
