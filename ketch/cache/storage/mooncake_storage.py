"""The Mooncake store backend of L3 (`mooncake://master-host:port`).

Mooncake's store is a distributed key -> bytes cache: a master (`mooncake_master`) keeps the
metadata, and each client, this engine included, lends memory (its global segment) that the
objects are spread over. Transfers go over TCP; clients find each other by a direct handshake
("P2PHANDSHAKE"), so neither etcd nor RDMA is needed. The master evicts objects when the segments
fill up, the middle of a prefix included, which `exists_prefix` is built for: it asks about all
the keys in one `batch_is_exist` call.

The package (`mooncake-transfer-engine-non-cuda`) is imported only when this backend is opened.
What the client does on a bad day, and what this file does about it (ketch/cache/README.md has
the measurements):
- with its master gone each call blocks about 4.4 s, with no timeout of its own: calls run on one
  worker thread (bounded_call.py) and the caller waits at most `timeout_ms`; while the client says
  the master is unreachable (`health_check`, a flag its pinger keeps) nothing is asked at all. The
  client reconnects by itself when the master is back (the master's objects are gone then).
- `setup` against a master that does not answer retries for about 90 s holding the GIL, which
  would freeze the whole engine: the master's port is tried with a plain connect first, and a
  failed connect is tried again, at most every `reconnect_s`, on a later call.
- `get` answers b"" for a missing key and for a failure alike; Mooncake stores no empty value, so
  an empty answer is followed by `is_exist` to tell a miss from an error.
- `put` of a key that exists keeps the old value and says it succeeded: `upsert` is used, so that a
  page that was rewritten (one the codec rejected, say) is really replaced.
- A value larger than the client's local buffer (`local_buffer_mb`) cannot be written: dropped.

Never raises into the engine on a failure of the store: a failed get is a miss (`read_errors`), a
failed set a dropped write (`dropped_writes`), a failed exists a no; each request that was made
and failed (an error code, an exception, the deadline) also counts in `errors`.
"""
from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

from ketch.cache.storage.backend import FAILED, Failed, StorageStats, check_key
from ketch.cache.storage.bounded_call import BoundedWorker, WorkerBusy

log = logging.getLogger("ketch.cache.storage")

DEFAULT_URL = "mooncake://127.0.0.1:50051"  # mooncake_master's default port
URL_FORM = ("mooncake://master-host:port[?global_segment_mb=N&local_buffer_mb=N&timeout_ms=N"
            "&local_hostname=HOST]")
INSTALL = "pip install mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)"
T = TypeVar("T")


@dataclass(frozen=True)
class MooncakeConfig:
    master_host: str
    master_port: int
    global_segment_mb: int = 512  # memory this engine lends to the store (touched as it fills)
    local_buffer_mb: int = 64  # staging memory for transfers: the largest value that can be written
    timeout_ms: int = 2000  # the most one call may hold the engine up
    local_hostname: str | None = None  # where peers reach this client; None: see local_address

    @property
    def master(self) -> str:
        host = f"[{self.master_host}]" if ":" in self.master_host else self.master_host
        return f"{host}:{self.master_port}"


def parse_url(url: str) -> MooncakeConfig:
    """The config in `url` (URL_FORM), else ValueError naming the field. No user, password, path or
    fragment: nothing here would use them, so they are refused rather than ignored."""
    bad = ValueError(f"hicache_storage_url: the mooncake backend takes {URL_FORM}, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0..65535
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True) if parts.query else []
    except (ValueError, TypeError, AttributeError):
        raise bad from None
    if parts.scheme != "mooncake" or not parts.hostname or not port or parts.path not in ("", "/"):
        raise bad
    if parts.username is not None or parts.password is not None or parts.fragment:
        raise bad
    fields: dict[str, Any] = {}
    for name, value in query:
        if name in fields or name not in ("global_segment_mb", "local_buffer_mb", "timeout_ms", "local_hostname"):
            raise bad
        if name == "local_hostname":
            if not value or any(c.isspace() for c in value):
                raise bad
            fields[name] = value
            continue
        least = 0 if name == "global_segment_mb" else 1  # a client may lend nothing and only use others'
        if not value.isdigit() or int(value) < least:
            raise bad
        fields[name] = int(value)
    return MooncakeConfig(parts.hostname, port, **fields)


def local_address(master_host: str, master_port: int) -> str:
    """This machine's address on the route to the master (a UDP connect sends nothing): peers
    fetch the objects in this client's segment from it, so it must not be a loopback address
    unless the master is local too."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_host, master_port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _import_client() -> type:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:  # no package, or no libibverbs.so.1 for its extension
        raise ImportError(f"hicache_storage_backend mooncake needs the Mooncake store client: {INSTALL}; "
                          f"importing mooncake.store said: {e}") from e
    return MooncakeDistributedStore


class _NotAsked(Exception):
    """Nothing was sent: not connected (a reconnect is not due yet) or the master is unreachable."""


class _ErrorReply(Exception):
    """The client answered with an error code."""


class MooncakeStorage:
    def __init__(self, url: str = DEFAULT_URL, *, reconnect_s: float = 5.0) -> None:
        """Connects now, within the deadline; a master that is down does not stop the engine from
        starting (the requests fail and are counted instead, and the connect is tried again)."""
        self.config = parse_url(url)
        self._client_type = _import_client()
        self.url, self.reconnect_s = url, reconnect_s
        self.stats = StorageStats()
        self.client: Any = None  # the connected MooncakeDistributedStore; only the worker touches it
        self._next_connect = 0.0
        self._answering = True  # for logging only the changes
        self._worker = BoundedWorker(self.config.timeout_ms / 1000, name="ketch-mooncake")
        self._call(lambda client: None)

    def get(self, key: str) -> bytes | None:
        check_key(key)
        return self.stats.count_get(self._call(lambda client: _read(client, key)))

    def set(self, key: str, value: bytes) -> bool:
        check_key(key)
        self.stats.sets += 1
        if isinstance(self._call(lambda client: _ok(client.upsert(key, value), "upsert")), Failed):
            self.stats.dropped_writes += 1
            return False
        self.stats.written_bytes += len(value)
        return True

    def exists(self, key: str) -> bool:
        check_key(key)
        return self._call(lambda client: _ok(client.is_exist(key), "is_exist")) == 1

    def exists_prefix(self, keys: Sequence[str]) -> int:
        names = [check_key(k) for k in keys]  # every key checked before anything is sent
        if not names:
            return 0
        found = self._call(lambda client: client.batch_is_exist(names))
        if isinstance(found, Failed):
            return 0
        count = 0
        for present in found:  # 1 present, 0 missing, negative an error for that key
            if present != 1:
                break
            count += 1
        return count

    def close(self) -> None:
        """Unmount this client's segment and stop the worker. With the master gone this takes a
        few seconds: Mooncake's teardown retries the unmount holding the GIL."""
        try:
            self._worker.run(self._teardown)
        except Exception:  # a teardown that failed or passed the deadline: nothing more to do
            pass
        self._worker.close()

    def _teardown(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()

    def _call(self, op: Callable[[Any], T]) -> T | Failed:
        """op(client) on the worker within the deadline, or FAILED. A request that was made and
        failed counts in stats.errors; one not made (not connected, master unreachable, a late
        call still running) does not."""
        try:
            result = self._worker.run(lambda: op(self._connected()))
        except (WorkerBusy, _NotAsked):
            return FAILED
        except Exception as e:  # DeadlinePassed, _ErrorReply, OSError, or the client raised
            self.stats.errors += 1
            if self._answering:
                log.warning("mooncake store at %s: %s: %s (L3 requests fail until it answers again)",
                            self.config.master, type(e).__name__, e)
            self._answering = False
            return FAILED
        if not self._answering:
            log.warning("mooncake store at %s answers again", self.config.master)
        self._answering = True
        return result

    def _connected(self) -> Any:
        """The client, connected and with a reachable master, else _NotAsked (on the worker)."""
        if self.client is None:
            self._connect()
        if self.client.health_check() != 0:  # a flag its pinger keeps: free to ask
            raise _NotAsked("the master is unreachable")
        return self.client

    def _connect(self) -> None:
        now = time.monotonic()
        if now < self._next_connect:
            raise _NotAsked("not connected; the next try is not due yet")
        self._next_connect = now + self.reconnect_s
        c = self.config
        # setup retries for ~90 s, holding the GIL, when the master does not answer: ask first
        with socket.create_connection((c.master_host, c.master_port), timeout=c.timeout_ms / 1000):
            pass
        client = self._client_type()
        local = c.local_hostname or local_address(c.master_host, c.master_port)
        rc = client.setup(local, "P2PHANDSHAKE", c.global_segment_mb << 20, c.local_buffer_mb << 20,
                          "tcp", "", c.master)
        if rc != 0:
            raise _ErrorReply(f"setup returned {rc}")
        self.client = client


def _ok(code: int, what: str) -> int:
    """`code` when it is not an error (negative), else _ErrorReply naming the call."""
    if code < 0:
        raise _ErrorReply(f"{what} returned {code}")
    return code


def _read(client: Any, key: str) -> bytes | None:
    data = client.get(key)
    if data:
        return bytes(data)
    # b"" is both "missing" and "failed"; no empty value can be stored, so ask which
    if _ok(client.is_exist(key), "is_exist") == 0:
        return None
    raise _ErrorReply(f"get {key!r} read nothing, yet the key exists")
