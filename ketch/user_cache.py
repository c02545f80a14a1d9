"""The user's cache directory, where ketch keeps what it can rebuild (converted tokenizers, L3 KV
pages by default): $XDG_CACHE_HOME/ketch, else ~/.cache/ketch (the XDG base directory spec)."""
from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(*parts: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"  # the spec ignores a relative value
    return root.joinpath("ketch", *parts)
