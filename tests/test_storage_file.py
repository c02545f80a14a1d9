"""The L3 file backend: set/get/exists, exists_prefix counting only the leading run, atomic
writes (no temp file left, a reader never sees half a value), URLs and the default directory,
and writes that cannot happen (read-only folder, a path through a regular file, a full disk)
dropped and counted, never raised."""
from __future__ import annotations

import errno
import os

import pytest

from ketch.cache.storage import FileStorage, StorageBackend, default_file_dir, open_backend

IS_ROOT = os.geteuid() == 0


def keys(n: int) -> list[str]:
    return [f"{i:02x}page{i}" for i in range(n)]


def test_round_trip_and_misses(tmp_path):
    store = FileStorage(tmp_path / "kv")  # created on the first write
    assert isinstance(store, StorageBackend)
    assert store.get("abc") is None and not store.exists("abc")
    assert store.set("abc", b"\x00\x01payload")
    assert store.exists("abc") and store.get("abc") == b"\x00\x01payload"
    assert store.set("abc", b"new")  # overwrite replaces
    assert store.get("abc") == b"new"
    assert (store.stats.gets, store.stats.hits, store.stats.sets, store.stats.dropped_writes) == (3, 2, 2, 0)
    assert store.stats.written_bytes == len(b"\x00\x01payload") + 3 and store.stats.read_bytes == 12
    assert (tmp_path / "kv" / "ab" / "abc").is_file()  # sharded by the key's first two characters
    assert not [p for p in (tmp_path / "kv").rglob(".tmp-*")]  # the temp file was renamed


def test_exists_prefix_counts_only_the_leading_run(tmp_path):
    store = FileStorage(tmp_path)
    ks = keys(5)
    assert store.exists_prefix(ks) == 0
    for k in ks:
        store.set(k, k.encode())
    assert store.exists_prefix(ks) == 5
    assert store.exists_prefix([]) == 0
    os.unlink(store.path(ks[2]))  # an LRU store dropped the middle of the prefix
    assert store.exists_prefix(ks) == 2
    assert store.exists(ks[3])  # present, but after the hole: not counted
    os.unlink(store.path(ks[0]))
    assert store.exists_prefix(ks) == 0


@pytest.mark.parametrize("bad", ["", ".hidden", "a/b", "../x", "k\x00", "x" * 201, "sp ace"])
def test_a_bad_key_is_a_value_error_naming_key(tmp_path, bad):
    store = FileStorage(tmp_path)
    for call in (lambda: store.get(bad), lambda: store.set(bad, b"v"), lambda: store.exists(bad)):
        with pytest.raises(ValueError, match="key"):
            call()


@pytest.mark.skipif(IS_ROOT, reason="root ignores directory permissions (the not-a-folder case covers it)")
def test_a_write_into_a_read_only_folder_is_dropped_and_counted(tmp_path):
    store = FileStorage(tmp_path)
    store.set("ab0", b"old")
    (tmp_path / "ab").chmod(0o500)
    tmp_path.chmod(0o500)
    try:
        assert store.set("ab1", b"v") is False and store.set("cd1", b"v") is False
        assert store.stats.dropped_writes == 2 and store.get("ab0") == b"old"
        assert not store.exists("ab1") and not store.exists("cd1")
    finally:
        (tmp_path / "ab").chmod(0o700)
        tmp_path.chmod(0o700)


def test_a_write_under_a_regular_file_is_dropped_and_counted(tmp_path):
    """The directory's parent is a file (NotADirectoryError): works as root too."""
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a folder")
    store = FileStorage(blocker / "kv")
    assert store.set("abc", b"v") is False
    assert store.stats.dropped_writes == 1 and store.stats.written_bytes == 0
    assert store.get("abc") is None and store.exists_prefix(["abc"]) == 0
    assert blocker.read_bytes() == b"not a folder"


def test_a_full_disk_drops_the_write_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """ENOSPC at the rename (the OS's call, not ketch's code, is what fails): the old value stays,
    the temp file is removed."""
    store = FileStorage(tmp_path)
    assert store.set("abc", b"old")

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert store.set("abc", b"new") is False
    monkeypatch.undo()
    assert store.stats.dropped_writes == 1 and store.get("abc") == b"old"
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def test_an_unreadable_entry_is_a_counted_miss(tmp_path):
    store = FileStorage(tmp_path)
    store.path("abc").mkdir(parents=True)  # a folder where the file should be: IsADirectoryError
    assert store.get("abc") is None and store.stats.read_errors == 1 and not store.exists("abc")


def test_urls_and_the_default_directory(tmp_path, monkeypatch):
    assert open_backend("file", f"file://{tmp_path}/kv").root == tmp_path / "kv"
    assert open_backend("file", "file://localhost/tmp/a%20b").root.as_posix() == "/tmp/a b"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_file_dir() == tmp_path / "xdg" / "ketch" / "kv"
    assert open_backend("file").root == tmp_path / "xdg" / "ketch" / "kv"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # the XDG spec says to ignore it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_file_dir() == tmp_path / "home" / ".cache" / "ketch" / "kv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_file_dir() == tmp_path / "home" / ".cache" / "ketch" / "kv"


@pytest.mark.parametrize("kind, url, field", [
    ("s3", None, "hicache_storage_backend"),
    ("file", "redis://127.0.0.1:6379/0", "hicache_storage_url"),
    ("file", "file://host/dir", "hicache_storage_url"),
    ("file", "/no/scheme", "hicache_storage_url"),
])
def test_bad_backend_or_url_names_the_field(kind, url, field):
    with pytest.raises(ValueError, match=field):
        open_backend(kind, url)
