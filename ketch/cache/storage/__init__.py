"""L3 storage: the `StorageBackend` interface and its backends, file, Redis and Mooncake.

`open_backend(kind, url)` builds one from the engine's flags; `url` None is the backend's
default: for "file" a directory under the user's cache directory ($XDG_CACHE_HOME/ketch/kv, else
~/.cache/ketch/kv), for "redis" redis://127.0.0.1:6379/0, for "mooncake" a master on this
machine (mooncake://127.0.0.1:50051).
"""
from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from ketch.cache.storage.backend import StorageBackend, StorageStats, check_key
from ketch.cache.storage.file import FileStorage
from ketch.config import HICACHE_STORAGE_BACKENDS
from ketch.user_cache import user_cache_dir

BACKENDS = HICACHE_STORAGE_BACKENDS  # one list for the flags and the factory

__all__ = ["BACKENDS", "FileStorage", "StorageBackend", "StorageStats", "check_key", "default_file_dir",
           "open_backend"]  # RedisStorage, MooncakeStorage: from their modules (below, why)


def default_file_dir() -> Path:
    """Where the file backend keeps pages when no URL is given (XDG base directory spec)."""
    return user_cache_dir("kv")


def open_backend(kind: str, url: str | None = None) -> StorageBackend:
    """The backend `kind` at `url` (ValueError naming the field on anything else)."""
    if kind not in BACKENDS:
        raise ValueError(f"hicache_storage_backend must be one of {'|'.join(BACKENDS)}, got {kind!r}")
    if kind == "redis":
        # imported here: redis-py takes ~0.1 s to import, which only an engine using it should pay
        from ketch.cache.storage.redis_storage import DEFAULT_URL, RedisStorage

        return RedisStorage(DEFAULT_URL if url is None else url)
    if kind == "mooncake":
        # imported here, like the package it wraps: only an engine that uses Mooncake needs it
        from ketch.cache.storage.mooncake_storage import DEFAULT_URL, MooncakeStorage

        return MooncakeStorage(DEFAULT_URL if url is None else url)
    return _open_file(url)


def _open_file(url: str | None) -> FileStorage:
    if url is None:
        return FileStorage(default_file_dir())
    parsed = urlparse(url)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost") or not parsed.path:
        raise ValueError(f"hicache_storage_url: the file backend takes file:///absolute/dir, got {url!r}")
    return FileStorage(unquote(parsed.path))
