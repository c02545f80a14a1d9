"""The Redis backend of L3: one Redis string per key (`redis://host:port[/db]`).

Meant for a Redis run as a pure cache (no persistence, `maxmemory` with an LRU policy): it
drops keys on its own, the middle of a prefix included, which `exists_prefix` is built for; it
asks about all the keys in one pipelined round trip rather than one trip per page.

Keys are stored under a namespace ("ketch:kv:" by default) so that a Redis shared with other
programs can tell ketch's pages apart (`redis-cli --scan --pattern 'ketch:kv:*'`).

Never raises into the engine on a failure of Redis: a failed get is a miss (`read_errors`), a
failed set a dropped write (`dropped_writes`), a failed exists a no; each failed request also
counts in `errors`. Two things bound how long a dead Redis can hold the engine up:
- the socket timeout (`timeout_s`, connect and each reply) and no retries (redis-py retries 3
  times by default, each try up to the timeout): one request waits at most about 2 × timeout_s
  (a connect, then the reply);
- after a connection failure or a timeout the backend leaves Redis alone for `cooldown_s`: calls
  in that window fail at once, so a Redis that hangs (a stopped process, a lost network) costs one
  timeout per cool-down, not one per page.
After the cool-down the next call tries again; redis-py's pool drops a connection that failed and
opens a new one, so the backend reconnects by itself when the server is back.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ketch.cache.storage.backend import FAILED, Failed, StorageStats, check_key

DEFAULT_URL = "redis://127.0.0.1:6379/0"
NAMESPACE = "ketch:kv:"

T = TypeVar("T")


def parse_url(url: str) -> tuple[str, int, int]:
    """(host, port, db) of `redis://host:port[/db]`, else ValueError naming the field. No user,
    password, query or fragment: nothing here would use them, so they are refused, not ignored."""
    bad = ValueError(f"hicache_storage_url: the redis backend takes redis://host:port[/db], got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0..65535
    except (ValueError, TypeError, AttributeError):
        raise bad from None
    if parts.scheme != "redis" or not parts.hostname or not port:
        raise bad
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise bad
    if not re.fullmatch(r"/?|/[0-9]{1,5}", parts.path):
        raise bad
    return parts.hostname, port, int(parts.path[1:] or 0)


class RedisStorage:
    def __init__(self, url: str = DEFAULT_URL, *, timeout_s: float = 0.5, cooldown_s: float = 1.0,
                 namespace: str = NAMESPACE) -> None:
        """No connection is opened here: a Redis that is down must not stop the engine from
        starting (its requests fail and are counted instead, until it is up)."""
        host, port, db = parse_url(url)
        if not timeout_s > 0 or not cooldown_s >= 0:
            raise ValueError(f"timeout_s must be > 0 and cooldown_s >= 0, got {timeout_s}, {cooldown_s}")
        self.url, self.namespace, self.cooldown_s = url, namespace, cooldown_s
        self.stats = StorageStats()
        self._down_until = 0.0  # time.monotonic() before which Redis is not asked
        self._client = redis.Redis(host=host, port=port, db=db, socket_timeout=timeout_s,
                                   socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))

    def name(self, key: str) -> str:
        """The Redis key that stores `key` (ValueError on a malformed key, before any request)."""
        return self.namespace + check_key(key)

    def get(self, key: str) -> bytes | None:
        name = self.name(key)
        return self.stats.count_get(self._request(lambda: self._client.get(name)))

    def set(self, key: str, value: bytes) -> bool:
        name = self.name(key)
        self.stats.sets += 1
        if isinstance(self._request(lambda: self._client.set(name, value)), Failed):
            self.stats.dropped_writes += 1
            return False
        self.stats.written_bytes += len(value)
        return True

    def exists(self, key: str) -> bool:
        name = self.name(key)
        found = self._request(lambda: self._client.exists(name))
        return not isinstance(found, Failed) and found == 1

    def exists_prefix(self, keys: Sequence[str]) -> int:
        names = [self.name(k) for k in keys]  # every key checked before anything is sent
        if not names:
            return 0
        found = self._request(lambda: self._pipelined_exists(names))
        if isinstance(found, Failed):
            return 0
        count = 0
        for present in found:
            if not present:
                break
            count += 1
        return count

    def close(self) -> None:
        """Close the pool's connections (a later call opens a new one)."""
        self._client.close()

    def _pipelined_exists(self, names: list[str]) -> list[int]:
        # transaction=False: a plain pipeline, no MULTI/EXEC; the answers need not be atomic,
        # the keys may be evicted right after anyway
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return pipe.execute()

    def _request(self, call: Callable[[], T]) -> T | Failed:
        """`call()`, or FAILED when it raised a Redis error (counted) or Redis is cooling down."""
        if time.monotonic() < self._down_until:
            return FAILED
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError):
            self.stats.errors += 1
            self._down_until = time.monotonic() + self.cooldown_s
            return FAILED
        except redis.RedisError:  # an error reply (OOM under noeviction, ...): the server is there
            self.stats.errors += 1
            return FAILED
