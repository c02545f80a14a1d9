"""A worker's address as the operator writes it -> the canonical URL the gateway keys it by, and
the API key that may ride in it.

A worker behind `ketch serve --api-key K` is written `http://:K@host:port` (the key as the URL's
password, percent-encoded where needed). The canonical URL carries no credentials: it is what
/workers, /metrics labels and the `x-ketch-worker` header show, so a key never leaks there.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class WorkerAddress:
    url: str  # scheme://host[:port], lower-case scheme and host, no trailing slash
    api_key: str | None  # from the URL's password; None: the gateway's --worker-api-key applies


def parse_worker_url(text: str) -> WorkerAddress:
    """The canonical address, or a ValueError that says what is wrong with `text`."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"worker url: expected a non-empty string like 'http://127.0.0.1:30000', got {text!r}")
    try:
        parts = urlsplit(text.strip())
        port = parts.port  # raises on a port that is not a number in range
    except ValueError as e:
        raise ValueError(f"worker url {text!r}: {e}") from None
    if port == 0:
        raise ValueError(f"worker url {text!r}: Port 0 is not a worker's port")
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"worker url {text!r}: the scheme must be http or https")
    if not parts.hostname:
        raise ValueError(f"worker url {text!r}: no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"worker url {text!r}: only scheme://host:port is allowed (no path, query or fragment)")
    if parts.username and parts.password is None:
        raise ValueError(f"worker url {text!r}: write the worker's API key as the password: http://:KEY@host:port")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    url = f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")
    key = unquote(parts.password) if parts.password else None
    return WorkerAddress(url=url, api_key=key)
