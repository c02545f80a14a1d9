"""One KV page as bytes for a storage tier, and back, checked on the way in.

    prefix   magic "KTKVPAGE" | u16 version | u16 checksum id | u32 header bytes | u64 payload bytes
    header   JSON: the PageFormat (model fingerprint, KV dtype, page size, layout, TP rank/size),
             the page's token count and its storage key
    payload  for each layer, for each tensor in the layout's order: the page's rows, raw bytes
    checksum u64 (little-endian) over prefix + header + payload

`decode` trusts nothing: it checks the structure, the checksum, then that the header names the
format the caller expects and the key the caller read it under (an intact page under another
page's key, e.g. files renamed or a store that mixed up its values, would otherwise be the
KV of other tokens), and raises `PageRejected(reason)` on the first thing wrong. A page
that fails here is dropped and its tokens recomputed; it is never partly used.

Checksum: xxh3-64 when the `xxhash` package is installed, else zlib's CRC-32 (in the standard
library; the venv has neither xxhash nor crc32c). The id in the prefix says which one wrote a
page, so pages written with either stay readable where both exist.
"""
from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ketch.cache.page_format import PageFormat, dtype_of

try:  # optional: faster and 64-bit; not a dependency
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

MAGIC = b"KTKVPAGE"
VERSION = 2  # 2: the header holds the page's key
_PREFIX = struct.Struct("<8sHHIQ")
_CHECKSUM = struct.Struct("<Q")

CHECKSUMS: dict[int, Callable[[bytes], int]] = {1: zlib.crc32}
if xxhash is not None:  # pragma: no cover
    CHECKSUMS[2] = xxhash.xxh3_64_intdigest
DEFAULT_CHECKSUM = max(CHECKSUMS)

# Why a page was refused: the first group means damaged bytes, the second a page of another
# model or configuration (intact, but not ours to use).
CORRUPT = ("magic", "version", "truncated", "length", "checksum_algo", "checksum", "header", "payload_size", "key")
FOREIGN = ("fingerprint", "kv_dtype", "page_size", "layout", "tp_rank", "tp_size", "tokens")

Layers = Sequence[Mapping[str, torch.Tensor]]  # KVPool.layers / HostPool.layers: [layer][name] -> [pages, page_size, *shape]


class PageRejected(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        assert reason in CORRUPT or reason in FOREIGN, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.corrupt = reason in CORRUPT


@dataclass(frozen=True)
class DecodedPage:
    tokens: int  # how many of the page's rows hold tokens (a whole page: page_size)
    layers: tuple[dict[str, torch.Tensor], ...]  # [layer][name] -> [page_size, *shape], on the CPU


def encode_page(layers: Layers, page: int, fmt: PageFormat, tokens: int | None = None, *, key: str) -> bytes:
    """Page `page` of every tensor of every layer of a pool (device or host) as one blob, to be
    stored under `key`."""
    tokens = fmt.page_size if tokens is None else tokens
    if not 1 <= tokens <= fmt.page_size:
        raise ValueError(f"tokens must be in [1, page_size={fmt.page_size}], got {tokens}")
    _check_layers(layers, fmt)
    payload = b"".join(_row_bytes(layers[layer][t.name][page])
                       for layer in range(fmt.num_layers) for t in fmt.tensors)
    header = json.dumps({"format": fmt.to_json(), "tokens": tokens, "key": key}, sort_keys=True).encode()
    body = _PREFIX.pack(MAGIC, VERSION, DEFAULT_CHECKSUM, len(header), len(payload)) + header + payload
    return body + _CHECKSUM.pack(CHECKSUMS[DEFAULT_CHECKSUM](body))


def decode_page(data: bytes, fmt: PageFormat, *, key: str) -> DecodedPage:
    """The page in `data`, read under `key`, if it is intact, of format `fmt` and written for
    that key; else PageRejected naming why."""
    header, payload = _unwrap(data)
    try:
        fields = json.loads(header)
        found, tokens, written_for = PageFormat.from_json(fields["format"]), fields["tokens"], fields["key"]
    except (ValueError, KeyError, TypeError) as e:
        raise PageRejected("header", f"unreadable header ({e})") from None
    _check_same_format(found, fmt)
    if written_for != key:
        raise PageRejected("key", f"the page was written for key {written_for!r}, read under {key!r}")
    if not isinstance(tokens, int) or not 1 <= tokens <= fmt.page_size:
        raise PageRejected("tokens", f"{tokens!r} tokens in a page of {fmt.page_size}")
    if len(payload) != fmt.payload_bytes:
        raise PageRejected("payload_size", f"{len(payload)} payload bytes, the format has {fmt.payload_bytes}")
    return DecodedPage(tokens, _split_payload(payload, fmt))


def load_page(layers: Layers, page: int, decoded: DecodedPage) -> None:
    """Write a decoded page into page `page` of a pool's tensors (device or host)."""
    for dst_layer, src_layer in zip(layers, decoded.layers, strict=True):
        for name, src in src_layer.items():
            dst = dst_layer[name][page]
            _raw(dst).copy_(_raw(src))


def _unwrap(data: bytes) -> tuple[bytes, bytes]:
    """(header, payload) of a structurally sound blob whose checksum matches."""
    if len(data) < _PREFIX.size:
        raise PageRejected("truncated", f"{len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, algo, header_len, payload_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise PageRejected("magic", f"{magic!r} is not a ketch KV page")
    if version != VERSION:
        raise PageRejected("version", f"format version {version}, this ketch reads {VERSION}")
    expected = _PREFIX.size + header_len + payload_len + _CHECKSUM.size
    if len(data) != expected:
        reason = "truncated" if len(data) < expected else "length"
        raise PageRejected(reason, f"{len(data)} bytes, the prefix promises {expected}")
    if algo not in CHECKSUMS:
        raise PageRejected("checksum_algo", f"checksum id {algo} is not available here ({sorted(CHECKSUMS)})")
    body = memoryview(data)[: expected - _CHECKSUM.size]
    (stored,) = _CHECKSUM.unpack_from(data, len(body))
    if CHECKSUMS[algo](body) != stored:
        raise PageRejected("checksum", "the page's bytes do not match its checksum")
    start = _PREFIX.size + header_len
    return bytes(data[_PREFIX.size : start]), bytes(data[start : start + payload_len])


def _check_same_format(found: PageFormat, fmt: PageFormat) -> None:
    for reason in ("fingerprint", "kv_dtype", "page_size"):
        if getattr(found, reason) != getattr(fmt, reason):
            raise PageRejected(reason, f"the page has {getattr(found, reason)!r}, expected {getattr(fmt, reason)!r}")
    if (found.num_layers, found.tensors) != (fmt.num_layers, fmt.tensors):
        raise PageRejected("layout", f"the page has {found.num_layers} layers of {found.tensors}, "
                                     f"expected {fmt.num_layers} of {fmt.tensors}")
    for reason in ("tp_rank", "tp_size"):
        if getattr(found, reason) != getattr(fmt, reason):
            raise PageRejected(reason, f"the page has {getattr(found, reason)}, expected {getattr(fmt, reason)}")


def _check_layers(layers: Layers, fmt: PageFormat) -> None:
    """The pool's tensors are the format's (a mismatch is the caller's bug: ValueError)."""
    if len(layers) != fmt.num_layers:
        raise ValueError(f"layers: {len(layers)} layers, the format has {fmt.num_layers}")
    for t in fmt.tensors:
        have = layers[0].get(t.name)
        want = (fmt.page_size, *t.shape)
        if have is None or tuple(have.shape[1:]) != want or have.dtype != dtype_of(t.dtype):
            found = None if have is None else (tuple(have.shape[1:]), have.dtype)
            raise ValueError(f"layers: tensor {t.name!r} should be pages of {want} {t.dtype}, got {found}")


def _split_payload(payload: bytes, fmt: PageFormat) -> tuple[dict[str, torch.Tensor], ...]:
    out, offset = [], 0
    for _ in range(fmt.num_layers):
        tensors = {}
        for t in fmt.tensors:
            n = fmt.page_size * t.bytes_per_token()
            # a fresh bytearray per tensor: aligned for its dtype and writable (torch.frombuffer warns otherwise)
            raw = torch.frombuffer(bytearray(payload[offset : offset + n]), dtype=torch.uint8)
            tensors[t.name] = raw.view(dtype_of(t.dtype)).view(fmt.page_size, *t.shape)
            offset += n
        out.append(tensors)
    return tuple(out)


def _row_bytes(t: torch.Tensor) -> bytes:
    return _raw(t.detach().contiguous().view(-1)).cpu().numpy().tobytes()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as uint8 (numpy has no bf16 or fp8; torch has no fp8 copy_ on every device)."""
    return t.view(torch.uint8)
