"""The GGUF tokenizer cache (ketch/text/tokenizer_cache.py): a cached tokenizer is the converted
one, entry for entry; a damaged cache is converted again, never used; a changed GGUF gets a new
entry; a cache folder that cannot be written costs only the conversion.

Every test points XDG_CACHE_HOME at its own folder, so none sees another's (or the user's) cache.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from ketch.text.tokenizer import Tokenizer
from ketch.text.tokenizer_cache import MANIFEST, cache_dir_for

TEXTS = ["Hello, world!", "  leading and trailing  ", "naïve café — 東京 🚀", "def f(x):\n\treturn x**2\n",
         "<|im_start|>user\nHi<|im_end|>", "1234567890 3.14159", "Hello , world . it 's", ""]


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def converted(smollm_path) -> PreTrainedTokenizerFast:
    """transformers' own conversion of the GGUF, no cache involved."""
    folder, name = os.path.split(smollm_path)
    return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)


def assert_same(tok: Tokenizer, hf: PreTrainedTokenizerFast) -> None:
    assert tok.hf.get_vocab() == hf.get_vocab()
    assert tok.chat_template == hf.chat_template and tok.chat_template
    assert (tok.bos_token, tok.eos_token, tok.all_special_ids) == (hf.bos_token, hf.eos_token, tuple(hf.all_special_ids))
    assert tok.hf.clean_up_tokenization_spaces == hf.clean_up_tokenization_spaces  # picks the decode path
    for text in TEXTS:
        ids = hf.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text


def test_the_first_load_caches_and_the_second_is_the_same_tokenizer(cache_home, smollm_path, converted):
    first = Tokenizer.load(smollm_path)
    folder = cache_dir_for(smollm_path)
    assert folder.parent.parent == cache_home / "ketch" and (folder / "tokenizer.json").is_file()
    manifest = json.loads((folder / MANIFEST).read_text())
    assert "tokenizer.json" in manifest
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging folder left behind
    assert_same(first, converted)
    second = Tokenizer.load(smollm_path)
    assert_same(second, converted)
    assert second.eos_token_ids == first.eos_token_ids


def test_the_second_load_reads_the_cache(cache_home, smollm_path):
    """A cache entry edited consistently (manifest updated) is what the next load returns: proof
    that it reads the cache rather than the GGUF."""
    Tokenizer.load(smollm_path)
    folder = cache_dir_for(smollm_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'edited' }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest.pop("chat_template.jinja", None)
    manifest["tokenizer_config.json"] = _sha256(folder / "tokenizer_config.json")
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert Tokenizer.load(smollm_path).chat_template == "{{ 'edited' }}"


@pytest.mark.parametrize("damage", ["flip_a_byte", "truncate", "no_manifest", "manifest_not_an_object", "extra_file"])
def test_a_damaged_cache_is_converted_again_not_used(cache_home, smollm_path, converted, damage):
    Tokenizer.load(smollm_path)
    folder = cache_dir_for(smollm_path)
    vocab = folder / "tokenizer.json"
    if damage == "flip_a_byte":  # the chat template changes and still loads: only the manifest can tell
        template = folder / "chat_template.jinja"
        template.write_text(template.read_text().replace("im_start", "im_stArt", 1))
    elif damage == "truncate":
        vocab.write_bytes(vocab.read_bytes()[: vocab.stat().st_size // 2])
    elif damage == "extra_file":  # transformers would read it; the manifest does not know it
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    elif damage == "no_manifest":
        (folder / MANIFEST).unlink()
    else:
        (folder / MANIFEST).write_text("[1, 2]")
    assert_same(Tokenizer.load(smollm_path), converted)
    manifest = json.loads((folder / MANIFEST).read_text())  # rewritten whole
    assert manifest["tokenizer.json"] == _sha256(vocab)
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # nothing staged or trashed left


def _load_at_once(gguf: str, cache_home: str, barrier) -> tuple[int, str, list[int]]:
    os.environ["XDG_CACHE_HOME"] = cache_home
    barrier.wait()  # every process past its imports: the loads start together
    tok = Tokenizer.load(gguf)
    return len(tok.hf.get_vocab()), tok.chat_template, tok.encode(TEXTS[2])


def test_processes_starting_together_each_get_the_whole_tokenizer(cache_home, smollm_path, converted):
    """An engine and API processes load the tokenizer at the same moment on a cold cache: each
    converts or reads a whole copy, one copy is kept, nothing half-written is left behind."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Manager().Barrier(3)
    with ctx.Pool(3) as pool:
        got = pool.starmap(_load_at_once, [(smollm_path, str(cache_home), barrier)] * 3)
    want = (len(converted.get_vocab()), converted.chat_template, converted.encode(TEXTS[2]))
    assert got == [want] * 3
    folder = cache_dir_for(smollm_path)
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]
    assert_same(Tokenizer.load(smollm_path), converted)


def test_a_changed_file_gets_a_new_entry(cache_home, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    before = cache_dir_for(str(gguf))
    os.utime(gguf, ns=(0, 10**9))
    touched = cache_dir_for(str(gguf))
    gguf.write_bytes(b"GGUF" + bytes(61))
    os.utime(gguf, ns=(0, 10**9))
    grown = cache_dir_for(str(gguf))
    assert len({before, touched, grown}) == 3
    link = tmp_path / "link.gguf"
    link.symlink_to(gguf)
    assert cache_dir_for(str(link)) == grown  # the same file by another name


def test_an_unwritable_cache_only_costs_the_conversion(tmp_path, monkeypatch, smollm_path, converted):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a file fails, for root as well
    assert_same(Tokenizer.load(smollm_path), converted)


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
