"""The incremental JSON scanner the tool parsers validate call arguments with: it agrees with
json.loads on valid and mutated objects."""
from __future__ import annotations

import json
import random

from ketch.parsers.json_scan import DONE, ERROR, JsonScanner


def _scanner_accepts(text: str) -> bool:
    scanner, pos = JsonScanner(), 0
    while True:
        ev, pos = scanner.scan(text, pos)
        if ev == ERROR:
            return False
        if ev == DONE:
            return text[pos:].strip(" \t\n\r") == ""
        if pos >= len(text):
            return False


def _loads_accepts(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_json_scanner_agrees_with_json_loads() -> None:
    rng = random.Random(0)
    values = [0, -1, 1.5, -2.5e-3, 10**20, "", 'a"b\\', "é😀\n\u0001", "</tool_call>", True, False, None, [], {}]
    alphabet = list('{}[]",:0123456789-+.eE \n\\utrfalsn\x01é')
    checked = 0
    for _ in range(3000):
        obj = {"k": [rng.choice(values) for _ in range(3)], "o": {"x": rng.choice(values)}}
        chars = list(json.dumps(obj, ensure_ascii=rng.random() < 0.5))
        for _ in range(rng.randrange(3)):
            j = rng.randrange(len(chars))
            if rng.random() < 0.5:
                chars[j] = rng.choice(alphabet)
            else:
                chars.insert(j, rng.choice(alphabet))
        text = "".join(chars)
        if text.startswith("{"):  # the scanner is only ever started on an object
            assert _scanner_accepts(text) == _loads_accepts(text), text
            checked += 1
    assert checked > 2000
