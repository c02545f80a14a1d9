"""The file store's temp files of writers that died mid-write: a writer SIGKILLed between its
temp file and the rename left the temp in the store forever; a FileStorage that opens the
directory (and a long-running one, every sweep interval) removes it, and keeps what a live writer
may still rename (this host's live pids; another host's temps until they are an hour old),
committed pages and files that are not temps.

The writers are real child processes writing through FileStorage.set; each stops inside the write
once its temp file is on disk (os.replace, the rename, is wrapped to report the temp's path on a
pipe and wait on another), so the parent kills it or lets it finish at a known point, with no
sleep. A child given a host name writes as if from another machine of a shared store."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_util import parse_metrics
from test_hicache_l3 import file_url, l3_engine

from ketch.cache.storage.file import FileStorage
from ketch.server.metrics import ServerMetrics
from ketch.cache.storage.file_temps import STALE_TEMP_AGE_S

_WRITER = textwrap.dedent("""
    import os, socket, sys
    if sys.argv[3]:
        socket.gethostname = lambda: sys.argv[3]  # a writer on another host of the shared store
    from ketch.cache.storage.file import FileStorage
    rename = os.replace
    def paused(tmp, dst):
        print(tmp, flush=True)  # the temp file is written: tell the parent
        sys.stdin.read()  # and wait: killed here, or let go when the parent closes the pipe
        rename(tmp, dst)
    os.replace = paused
    print("stored" if FileStorage(sys.argv[1]).set(sys.argv[2], b"page from " + sys.argv[2].encode()) else "dropped")
""")


class Writers:
    """Child writers, each paused with its temp file on disk; any still running at the end of a
    test are killed."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, root: Path, key: str, host: str = "") -> tuple[subprocess.Popen[str], Path]:
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), key, host], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, proc.communicate()[1][-2000:]
        tmp = Path(line.strip())
        assert tmp.is_file() and tmp.read_bytes() == b"page from " + key.encode()
        return proc, tmp

    def kill(self, root: Path, key: str, host: str = "") -> Path:
        """The temp file a writer SIGKILLed mid-write left (the writer reaped: no zombie)."""
        proc, tmp = self.start(root, key, host)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        return tmp


@pytest.fixture
def writers() -> Iterator[Writers]:
    w = Writers()
    yield w
    for proc in w.procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def key(n: int) -> str:
    return f"{n:02x}page{n}"


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_killed_writers_temp_is_removed_a_live_ones_kept(tmp_path: Path, writers: Writers) -> None:
    """Same host: the dead pid's temp goes; the live writer's temp stays and its rename still
    lands after the sweep; committed pages and files that are not temps are untouched."""
    root = tmp_path / "kv"
    assert FileStorage(root).set(key(1), b"committed")
    live, live_tmp = writers.start(root, key(2))
    dead_tmp = writers.kill(root, key(3))
    (root / "README").write_text("an operator's note")
    (live_tmp.parent / "not-a-temp").write_text("someone else's file")
    assert dead_tmp.is_file()

    store = FileStorage(root)
    assert not dead_tmp.exists() and store.stats.stale_temps_removed == 1
    assert live_tmp.is_file()
    assert store.get(key(1)) == b"committed" and not store.exists(key(3))
    assert (root / "README").read_text() == "an operator's note"
    assert (live_tmp.parent / "not-a-temp").read_text() == "someone else's file"

    out, err = live.communicate("")  # let the live writer rename: its temp was still there
    assert (live.returncode, out.strip()) == (0, "stored"), err[-2000:]
    assert store.get(key(2)) == b"page from " + key(2).encode() and not live_tmp.exists()
    assert FileStorage(root).stats.stale_temps_removed == 0  # nothing left to sweep


def test_another_hosts_temp_is_removed_only_when_old(tmp_path: Path, writers: Writers) -> None:
    """A temp of another host cannot be asked about its pid: it stays while it may be in flight,
    and goes once older than STALE_TEMP_AGE_S; an old temp of this host goes even when its pid
    is alive (a reused pid: the write it names ended long ago)."""
    root = tmp_path / "kv"
    foreign = writers.kill(root, key(1), host="other-host-7")
    live, live_tmp = writers.start(root, key(2))
    store = FileStorage(root)
    assert foreign.is_file() and live_tmp.is_file() and store.stats.stale_temps_removed == 0

    age(foreign, STALE_TEMP_AGE_S - 300)  # old, not yet stale: kept
    assert FileStorage(root).stats.stale_temps_removed == 0 and foreign.is_file()
    age(foreign, STALE_TEMP_AGE_S + 60)
    assert FileStorage(root).stats.stale_temps_removed == 1 and not foreign.exists()
    assert live_tmp.is_file()

    age(live_tmp, STALE_TEMP_AGE_S + 60)
    assert FileStorage(root).stats.stale_temps_removed == 1 and not live_tmp.exists()
    out, _ = live.communicate("")  # its rename fails: the write is dropped, counted, not raised
    assert (live.returncode, out.strip()) == (0, "dropped")
    assert not FileStorage(root).exists(key(2))


def test_a_running_store_sweeps_again_after_its_interval(tmp_path: Path, writers: Writers) -> None:
    """A writer that dies while this engine runs: its temp goes at the first write after the
    sweep interval, not before (one scandir per interval, none per page)."""
    root = tmp_path / "kv"
    store = FileStorage(root)
    dead_tmp = writers.kill(root, key(1))
    assert store.set(key(2), b"v") and dead_tmp.is_file()  # within the interval: no sweep
    store.sweep_interval_s = 0.0
    assert store.set(key(3), b"v")
    assert not dead_tmp.exists() and store.stats.stale_temps_removed == 1
    assert store.get(key(2)) == b"v" and store.get(key(3)) == b"v"


def test_the_engine_reports_the_swept_temps(tiny_config_path: str, tmp_path: Path, writers: Writers) -> None:
    """An engine opening a store a writer died in counts the sweep in its stats and /metrics."""
    root = tmp_path / "kv"
    writers.kill(root, key(4))
    eng = l3_engine(tiny_config_path, file_url(root))
    try:
        s = eng.stats()
        assert s.storage_stale_temps_removed == 1
        assert parse_metrics(ServerMetrics().render(s).decode())["ketch_hicache_storage_stale_temps_removed_total"] == 1
    finally:
        eng.close()
