"""A GGUF's tokenizer, converted once per file: transformers rebuilds a fast tokenizer from the
GGUF's vocabulary and merges on every load (~1.8 s for the bundled 135M model, paid by the
engine and by every API process at each start); its saved tokenizer.json loads in ~0.15 s.

    key = sha256(format, the GGUF's real path, size, mtime, transformers' and tokenizers' versions)
    $XDG_CACHE_HOME/ketch/tokenizers/<key>/   tokenizer.json, tokenizer_config.json, ... + manifest.json

manifest.json holds each file's sha256: a cached tokenizer whose files do not match it (a torn
write, a disk error, a hand edit) is converted again, never used. A new, touched or replaced
GGUF (size, mtime, inode), or another transformers, gets a new key. A folder is never changed
in place: a new one is staged in a private temporary folder and renamed into place (a rename
onto an existing folder fails: the first process's copy stays), and a damaged one is first
renamed aside, then deleted; so a process that found a folder intact reads it whole, whatever
concurrent starts (the engine, several API processes) do. A cache that cannot be written only
costs the conversion. Entries of old keys are not swept (~3.5 MB each).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ketch.user_cache import user_cache_dir

FORMAT = 1  # of the cached folder; a change of layout bumps it
MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


def cache_dir_for(gguf_path: str) -> Path:
    import tokenizers
    import transformers

    st = os.stat(gguf_path)
    key = f"{FORMAT}|{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_dev}|{st.st_ino}|" \
          f"{transformers.__version__}|{tokenizers.__version__}"
    return user_cache_dir("tokenizers", hashlib.sha256(key.encode()).hexdigest()[:32])


def load_gguf_tokenizer(gguf_path: str) -> Any:
    """The transformers fast tokenizer of a GGUF file: from the cache when it holds an intact copy,
    else converted from the file (and cached)."""
    from transformers import PreTrainedTokenizerFast

    folder = cache_dir_for(gguf_path)
    if _intact(folder):
        try:
            hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
        except Exception as e:  # intact files transformers cannot read (e.g. written by a future format)
            log.warning("tokenizer cache %s unreadable (%s): converting the GGUF again", folder, e)
            _discard(folder)
        else:
            if _intact(folder):  # still there, whole, after the read: what was read is the manifest's
                return hf
    elif folder.exists():
        _discard(folder)
    directory, name = os.path.split(gguf_path)
    hf = PreTrainedTokenizerFast.from_pretrained(directory or ".", gguf_file=name)
    _store(hf, folder)
    return hf


def _intact(folder: Path) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if not manifest or set(os.listdir(folder)) != set(manifest) | {MANIFEST}:  # a file added or lost
            return False
        return all(_sha256(folder / name) == digest for name, digest in manifest.items())
    except (OSError, ValueError, AttributeError, TypeError):  # absent, torn, not a {name: digest} object
        return False


def _store(hf: Any, folder: Path) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
    except OSError as e:
        log.info("tokenizer cache %s not writable (%s): converting on every start", folder.parent, e)
        return
    try:
        hf.save_pretrained(str(staging))
        files = sorted(p.name for p in staging.iterdir())
        (staging / MANIFEST).write_text(json.dumps({name: _sha256(staging / name) for name in files}))
        os.rename(staging, folder)  # atomic; fails if another process got there first (theirs is as good)
    except OSError:
        pass
    except Exception as e:  # the tokenizer is converted and works: a cache failure must not cost it
        log.warning("tokenizer cache %s not written: %s: %s", folder, type(e).__name__, e)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _discard(folder: Path) -> None:
    """Rename a damaged folder aside (atomic: no reader sees it half deleted; one that was reading
    it finds it gone at its second check) and delete it there. Another process may have moved it
    first: then there is nothing to do."""
    try:
        trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=folder.parent))
    except OSError:
        return
    try:
        os.rename(folder, trash / "entry")
    except OSError:
        pass
    shutil.rmtree(trash, ignore_errors=True)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
