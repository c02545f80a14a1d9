"""Helpers shared by the `ketch bench serve` tests: the bundled tokenizer (loaded once per session)
handed to the CLI, and the printed result table read back as a dict."""
from __future__ import annotations

import functools

import pytest

from ketch.text.tokenizer import Tokenizer


@functools.cache
def _bundled_tokenizer() -> Tokenizer:
    return Tokenizer.load()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return _bundled_tokenizer()


@pytest.fixture(autouse=True)
def shared_tokenizer(request, monkeypatch):
    """The CLI loads the bundled tokenizer per run: hand it the test's one (seconds each on 2 cores).
    Autouse in every module that imports it."""
    if "tok" in request.fixturenames:
        shared = request.getfixturevalue("tok")
        monkeypatch.setattr(Tokenizer, "load", classmethod(lambda cls, path=None, field="model": shared))


def printed(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        label, sep, value = line.partition(":")
        if sep and value.strip():
            rows[label] = value.strip()
    return rows
