"""The file backend's temp files: who wrote each one, and the sweep that removes those no writer
will ever rename (a writer killed between create and rename, by SIGKILL, the OOM killer or a
power cut, leaves its temp behind; nothing else would ever remove it).

Every temp lives in one folder, `<root>/.tmp`, so a sweep is one scandir of a folder that holds
only writes in flight (and garbage), never a walk of the store's pages. Its name says who wrote it:

    .tmp-<pid>-<owner>-<random>        owner: the host name and the pid namespace ("node7+4026531836")

A temp is removed when
  - its owner is this one (same host, same pid namespace) and its pid is not alive: the writer
    is gone, nobody else renames another process's temp;
  - or it is older than STALE_TEMP_AGE_S, whoever wrote it: the pid of another host (or another
    container's pid namespace) cannot be asked, and a page write takes milliseconds, so an hour
    old temp is a dead writer's (or one whose pid was reused: the age catches that too).
Removing a temp that a live writer still meant to rename (a clock far off, a host name shared
across pid namespaces without the namespace telling them apart) costs that writer one page: its
rename fails, the write is dropped and counted, no reader ever sees a torn page.
"""
from __future__ import annotations

import functools
import os
import re
import socket
import time
from pathlib import Path

TEMP_DIR = ".tmp"  # keys never start with "." (backend.check_key): no shard folder is named so
TEMP_PREFIX = ".tmp-"
STALE_TEMP_AGE_S = 3600.0  # any writer's temp older than this is garbage (generous: NFS, clock skew)
SWEEP_INTERVAL_S = 600.0  # a long-running engine sweeps again this often (dead writers on other hosts)

# <pid>-<owner>-<mkstemp's random part: [a-z0-9_], never "-">; the owner may hold "-"
_NAME = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-(.+)-[a-z0-9_]+")


@functools.cache
def owner() -> str:
    """This machine and pid namespace: within it a pid names one process (a container with the
    host's network shares its host name, not its pids)."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "_"
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{host}+{namespace}"


def temp_prefix() -> str:
    """The name prefix of this process's next temp (the pid read now: a forked child is another
    writer)."""
    return f"{TEMP_PREFIX}{os.getpid()}-{owner()}-"


def sweep(folder: Path, now: float | None = None) -> int:
    """Remove the stale temps in `folder` (the store's TEMP_DIR); how many went. One scandir;
    any OSError (no folder yet, a store that cannot be read, a temp another sweeper removed
    first) removes nothing more and raises nothing."""
    now = time.time() if now is None else now
    removed = 0
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.startswith(TEMP_PREFIX) and _stale(entry, now):
                    removed += _unlink(entry.path)
    except OSError:
        pass
    return removed


def _stale(entry: os.DirEntry[str], now: float) -> bool:
    try:
        if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_AGE_S:
            return True
    except OSError:
        return False  # gone already (renamed by its writer, or swept by another engine)
    match = _NAME.fullmatch(entry.name)
    return match is not None and match[2] == owner() and not _alive(int(match[1]))


def _alive(pid: int) -> bool:
    """Whether `pid` names a process here; unsure (pid 0, no right to ask) counts as alive. A
    zombie is alive until its parent reaps it: its temp goes at a later sweep."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: another user's process
    return True


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
    except OSError:
        return 0
    return 1
