"""The file backend of L3: one file per key under a directory (`file:///dir`).

Files live in 256 shard folders named by the key's first two characters, so no folder grows
to millions of entries. A write goes to a temp file in `<dir>/.tmp`, then `os.replace` renames it
over the key (one file system: the rename is atomic): a reader (another engine on the same
directory, or this one after a crash) sees the old value or the new one, never a half-written
page. There is no fsync: after a power loss a page may be missing or torn, and the codec's
checksum rejects a torn page, so durability would buy nothing a cache needs.

Any OSError on a write (ENOSPC, EACCES, EROFS, a path that is not a folder) drops the write,
counts it and returns False; the engine keeps serving from its other tiers.

Temps of writers that died before their rename are swept (file_temps.py says which are stale):
when a FileStorage opens the directory and every SWEEP_INTERVAL_S after, from the writer's set(),
one scandir of `.tmp` each time; stats.stale_temps_removed counts them.
"""
from __future__ import annotations

import functools
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ketch.cache.storage import file_temps
from ketch.cache.storage.backend import StorageStats, check_key


class FileStorage:
    local = True  # exists() is a stat on this machine: cheap enough for the engine thread
    sweep_interval_s = file_temps.SWEEP_INTERVAL_S

    def __init__(self, root: str | os.PathLike[str]) -> None:
        """root: the directory; created on the first write (not here: a bad path must not stop
        the engine from starting, its writes are dropped and counted instead)."""
        self.root = Path(root)
        if "\x00" in str(root):
            raise ValueError(f"hicache_storage_url: the file backend's directory has a NUL byte: {root!r}")
        if not self.root.is_absolute():
            raise ValueError(f"hicache_storage_url: the file backend needs an absolute directory, got {root!r}")
        self.stats = StorageStats()
        self._last_sweep = 0.0
        self.sweep_temps()

    def sweep_temps(self) -> int:
        """Remove the temps that dead writers left (any engine's, on any host: file_temps.py);
        how many went, also added to stats.stale_temps_removed. Never raises."""
        self._last_sweep = time.monotonic()
        removed = file_temps.sweep(self.root / file_temps.TEMP_DIR)
        self.stats.stale_temps_removed += removed
        return removed

    def path(self, key: str) -> Path:
        check_key(key)
        return self.root / key[:2] / key

    def get(self, key: str) -> bytes | None:
        path = self.path(key)
        self.stats.gets += 1
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            self.stats.read_errors += 1
            return None
        self.stats.hits += 1
        self.stats.read_bytes += len(data)
        return data

    def set(self, key: str, value: bytes) -> bool:
        path = self.path(key)
        self.stats.sets += 1
        if time.monotonic() - self._last_sweep >= self.sweep_interval_s:
            self.sweep_temps()  # writers on other hosts die while this engine runs on
        try:
            _write_atomic(path, value, self.root / file_temps.TEMP_DIR)
        except OSError:
            self.stats.dropped_writes += 1
            return False
        self.stats.written_bytes += len(value)
        return True

    def exists(self, key: str) -> bool:
        """A stat, on the engine thread: any OSError other than "not there" (permissions, I/O,
        a stale NFS handle: is_file() raises those) is a miss, counted, never an exception."""
        try:
            return self.path(key).is_file()
        except OSError:
            self.stats.read_errors += 1
            return False

    def exists_prefix(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)


@functools.cache
def file_mode() -> int:
    """0o666 less the process umask (read once); from /proc (Linux), else by setting the umask and
    putting it back (a moment in which another thread's files would get umask 0: only where /proc
    lacks it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask



def _write_atomic(path: Path, value: bytes, temps: Path) -> None:
    """Write `value` to `path` through a temp file in `temps` (the store's temp folder: the same
    file system, where a rename is atomic); the temp file is removed when anything fails. Its name
    says which process wrote it, so a sweep can tell a dead writer's temp (file_temps.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temps.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=temps, prefix=file_temps.temp_prefix())
    try:
        # mkstemp makes 0600 files; a shared store's other engines (other users) must read them:
        # the mode a plain open() would give under this process's umask
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
