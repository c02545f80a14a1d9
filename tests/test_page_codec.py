"""L3 page serialization: real KVPool pages (MHA fp32/bf16/fp8, a mixed-dtype latent spec) through
encode -> file backend -> decode -> another pool's page, byte-identical; storage keys from chained
page hashes that differ for every other format; and every damaged or foreign page refused with
its reason (flipped byte, truncation, bad magic/version/checksum id, unreadable header, another
fingerprint / dtype / page size / layout / rank)."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from ketch.cache.kv_pool import KVPool
from ketch.cache.page_codec import (CHECKSUMS, CORRUPT, FOREIGN, MAGIC, PageRejected, decode_page, encode_page,
                                    load_page)
from ketch.cache.page_format import PageFormat, TensorLayout
from ketch.cache.page_hash import ROOT_HASH, chain_hashes
from ketch.cache.storage import FileStorage, check_key
from ketch.config import KVSpec, KVTensorSpec

PS = 4
LAYERS = 3
FP = "test-model@0123abcd"
PREFIX = struct.Struct("<8sHHIQ")


def pool(dtype=torch.float32, compute=torch.float32, page_size=PS, spec=None, pages=6) -> KVPool:
    """A small pool full of random bytes (every bit pattern, so a swapped or shifted byte shows)."""
    p = KVPool(spec or KVSpec.mha(LAYERS, 2, 4), pages, page_size, dtype, torch.device("cpu"), compute_dtype=compute)
    g = torch.Generator().manual_seed(0)
    for tensors in p.layers:
        for t in tensors.values():
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return p


def same_page(a: KVPool, pa: int, b: KVPool, pb: int) -> bool:
    return all(torch.equal(x[name][pa].view(torch.uint8), y[name][pb].view(torch.uint8))
               for x, y in zip(a.layers, b.layers) for name in x)


def reseal(blob: bytes, **changes) -> bytes:
    """`blob` with prefix fields or its header replaced and a valid checksum again: a page that is
    intact but says something else."""
    magic, version, algo, hlen, plen = PREFIX.unpack_from(blob)
    header = json.loads(blob[PREFIX.size : PREFIX.size + hlen])
    header = changes.pop("header", lambda h: h)(header)
    new_header = json.dumps(header).encode() if isinstance(header, dict) else header
    fields = {"magic": magic, "version": version, "algo": algo, **changes}
    body = (PREFIX.pack(fields["magic"], fields["version"], fields["algo"], len(new_header), plen) + new_header
            + blob[PREFIX.size + hlen : PREFIX.size + hlen + plen])
    return body + struct.pack("<Q", CHECKSUMS.get(fields["algo"], CHECKSUMS[algo])(body))


KEY = "the-key-it-was-written-for"


def rejected(blob: bytes, fmt: PageFormat, key: str = KEY) -> str:
    with pytest.raises(PageRejected) as info:
        decode_page(blob, fmt, key=key)
    return info.value.reason


MLA = KVSpec(LAYERS, (KVTensorSpec("latent", (6,)), KVTensorSpec("rope", (3,), "model"),
                      KVTensorSpec("pos", (1,), torch.int32)))


@pytest.mark.parametrize("dtype, compute, spec", [
    (torch.float32, torch.float32, None),
    (torch.bfloat16, torch.bfloat16, None),
    (torch.float8_e4m3fn, torch.bfloat16, None),  # --kv-cache-dtype fp8_e4m3
    (torch.float8_e4m3fn, torch.float32, MLA),  # three element types in one page
], ids=["fp32", "bf16", "fp8", "mixed"])
def test_pages_round_trip_through_the_file_backend_byte_identical(tmp_path, dtype, compute, spec):
    src, dst = pool(dtype, compute, spec=spec), pool(dtype, compute, spec=spec)
    for tensors in dst.layers:
        for t in tensors.values():
            t.view(torch.uint8).zero_()
    fmt = PageFormat.for_pool(src, FP)
    assert PageFormat.for_pool(dst, FP) == fmt
    store = FileStorage(tmp_path)
    hashes = chain_hashes(ROOT_HASH, list(range(3 * PS)), PS)
    for h, page in zip(hashes, [4, 0, 2]):
        assert store.set(fmt.key(h), encode_page(src.layers, page, fmt, key=fmt.key(h)))
    assert store.exists_prefix([fmt.key(h) for h in hashes]) == 3
    for h, page, into in zip(hashes, [4, 0, 2], [1, 5, 3]):
        decoded = decode_page(store.get(fmt.key(h)), fmt, key=fmt.key(h))
        assert decoded.tokens == PS
        load_page(dst.layers, into, decoded)
        assert same_page(src, page, dst, into)
    assert not dst.layers[0][fmt.tensors[0].name][0].view(torch.uint8).any()
    assert len(encode_page(src.layers, 0, fmt, key=KEY)) > fmt.payload_bytes == src.bytes_per_page


def test_exists_prefix_of_page_keys_stops_at_a_missing_middle_page(tmp_path):
    src = pool()
    fmt = PageFormat.for_pool(src, FP)
    store = FileStorage(tmp_path)
    keys = [fmt.key(h) for h in chain_hashes(ROOT_HASH, list(range(5 * PS)), PS)]
    for i, key in enumerate(keys):
        if i != 2:
            store.set(key, encode_page(src.layers, i, fmt, key=key))
    assert store.exists_prefix(keys) == 2
    assert store.exists(keys[3]) and store.exists(keys[4])


def test_keys_name_the_hash_and_the_whole_format():
    fmt = PageFormat.for_pool(pool(), FP)
    h = chain_hashes(ROOT_HASH, [1, 2, 3, 4], PS)[0]
    key = fmt.key(h)
    assert check_key(key) == key and key.startswith(h.hex()) and fmt.key(h) == key
    others = [
        PageFormat.for_pool(pool(), "other-model"),
        PageFormat.for_pool(pool(torch.bfloat16, torch.bfloat16), FP),
        PageFormat.for_pool(pool(page_size=8), FP),
        PageFormat.for_pool(pool(spec=KVSpec.mha(LAYERS, 1, 4)), FP),
        PageFormat.for_pool(pool(), FP, tp_rank=1, tp_size=2),
        PageFormat.for_pool(pool(), FP, tp_rank=0, tp_size=2),
    ]
    assert len({key} | {o.key(h) for o in others}) == 1 + len(others)
    assert fmt.key(chain_hashes(ROOT_HASH, [1, 2, 3, 5], PS)[0]) != key
    with pytest.raises(ValueError, match="page_hash"):
        fmt.key(ROOT_HASH)


@pytest.mark.parametrize("where", ["payload_first", "payload_last", "header", "checksum", "prefix_algo"])
def test_a_flipped_byte_is_detected(where):
    src = pool()
    fmt = PageFormat.for_pool(src, FP)
    blob = bytearray(encode_page(src.layers, 1, fmt, key=KEY))
    hlen = PREFIX.unpack_from(blob)[3]
    at = {"payload_first": PREFIX.size + hlen, "payload_last": len(blob) - 9, "header": PREFIX.size + 3,
          "checksum": len(blob) - 1, "prefix_algo": 10}[where]
    for bit in (0x01, 0x80):
        bad = bytearray(blob)
        bad[at] ^= bit
        assert rejected(bytes(bad), fmt) == ("checksum_algo" if where == "prefix_algo" else "checksum")
    assert decode_page(bytes(blob), fmt, key=KEY).tokens == PS  # the original still decodes


def test_truncated_extended_and_foreign_blobs_are_refused():
    src = pool()
    fmt = PageFormat.for_pool(src, FP)
    blob = encode_page(src.layers, 1, fmt, key=KEY)
    for cut in (0, 5, PREFIX.size, len(blob) // 2, len(blob) - 1):
        assert rejected(blob[:cut], fmt) == "truncated"
    assert rejected(blob + b"\x00", fmt) == "length"
    assert rejected(b"PK\x03\x04" + blob[4:], fmt) == "magic"
    assert rejected(reseal(blob, magic=b"KTKVPAGX"), fmt) == "magic"
    assert rejected(reseal(blob, version=1), fmt) == "version"  # before pages named their key
    assert rejected(reseal(blob, version=3), fmt) == "version"
    assert rejected(reseal(blob, algo=99), fmt) == "checksum_algo"
    assert rejected(reseal(blob, header=lambda h: b"{not json"), fmt) == "header"
    assert rejected(reseal(blob, header=lambda h: {"format": h["format"]}), fmt) == "header"
    assert rejected(reseal(blob, header=lambda h: {k: v for k, v in h.items() if k != "key"}), fmt) == "header"
    assert rejected(reseal(blob, header=lambda h: {**h, "tokens": 0}), fmt) == "tokens"
    assert rejected(reseal(blob, header=lambda h: {**h, "tokens": PS + 1}), fmt) == "tokens"
    assert decode_page(reseal(blob, header=lambda h: {**h, "tokens": 1}), fmt, key=KEY).tokens == 1
    assert decode_page(reseal(blob), fmt, key=KEY).tokens == PS  # reseal itself changes nothing


@pytest.mark.parametrize("reason, other", [
    ("fingerprint", lambda: PageFormat.for_pool(pool(), "another-model@ffff")),
    ("kv_dtype", lambda: PageFormat.for_pool(pool(torch.float8_e4m3fn, torch.float32), FP)),
    ("page_size", lambda: PageFormat.for_pool(pool(page_size=8), FP)),
    ("layout", lambda: PageFormat.for_pool(pool(spec=KVSpec.mha(LAYERS, 1, 8)), FP)),
    ("layout", lambda: PageFormat.for_pool(pool(spec=KVSpec.mha(LAYERS + 1, 2, 4)), FP)),
    ("tp_rank", lambda: PageFormat.for_pool(pool(), FP, tp_rank=1, tp_size=2)),
    ("tp_size", lambda: PageFormat.for_pool(pool(), FP, tp_rank=0, tp_size=2)),
])
def test_an_intact_page_of_another_format_is_refused_both_ways(reason, other):
    """A page written by another model/dtype/page size/layout/rank, intact (its checksum holds),
    is refused by ours, and ours by it: nothing of another configuration is ever used."""
    ours = PageFormat.for_pool(pool(), FP)
    theirs = other()
    their_pool = pool(dtype_of_fmt(theirs), torch.float32, theirs.page_size,
                      KVSpec(theirs.num_layers, tuple(KVTensorSpec(t.name, t.shape) for t in theirs.tensors)))
    assert rejected(encode_page(their_pool.layers, 0, theirs, key=KEY), ours) == reason
    assert rejected(encode_page(pool().layers, 0, ours, key=KEY), theirs) == reason
    assert reason in FOREIGN and "checksum" in CORRUPT


def dtype_of_fmt(fmt: PageFormat) -> torch.dtype:
    return getattr(torch, fmt.kv_dtype)


def test_a_pool_that_does_not_match_the_format_is_a_value_error():
    fmt = PageFormat.for_pool(pool(), FP)
    with pytest.raises(ValueError, match="layers"):
        encode_page(pool(torch.bfloat16, torch.bfloat16).layers, 0, fmt, key=KEY)
    with pytest.raises(ValueError, match="layers"):
        encode_page(pool(spec=KVSpec.mha(LAYERS + 1, 2, 4)).layers, 0, fmt, key=KEY)
    with pytest.raises(ValueError, match="tokens"):
        encode_page(pool().layers, 0, fmt, tokens=PS + 1, key=KEY)


@pytest.mark.parametrize("field, change", [
    ("fingerprint", {"fingerprint": ""}), ("fingerprint", {"fingerprint": "a\nb"}),
    ("kv_dtype", {"kv_dtype": "float99"}), ("page_size", {"page_size": 0}), ("num_layers", {"num_layers": 0}),
    ("tp_rank", {"tp_rank": 2, "tp_size": 2}), ("tp_size", {"tp_size": 0}), ("tensors", {"tensors": ()}),
    ("tensors", {"tensors": (TensorLayout("k", (2, 4), "float32"), "v")}),
])
def test_a_bad_format_is_a_value_error_naming_the_field(field, change):
    good = dict(fingerprint=FP, kv_dtype="float32", page_size=PS, num_layers=1,
                tensors=(TensorLayout("k", (2, 4), "float32"),), tp_rank=0, tp_size=1)
    PageFormat(**good)
    with pytest.raises(ValueError, match=field):
        PageFormat(**{**good, **change})


@pytest.mark.parametrize("name, shape, dtype", [("", (2,), "float32"), ("k", (), "float32"), ("k", (0,), "float32"),
                                                ("k", (2,), "complex999")])
def test_a_bad_tensor_layout_is_a_value_error_naming_tensors(name, shape, dtype):
    with pytest.raises(ValueError, match="tensors"):
        TensorLayout(name, shape, dtype)


def two_stored_pages(tmp_path) -> tuple[PageFormat, FileStorage, str, str]:
    """Two pages of a pool in a file store, each under its own key."""
    src = pool()
    fmt = PageFormat.for_pool(src, FP)
    store = FileStorage(tmp_path)
    a, b = (fmt.key(h) for h in chain_hashes(ROOT_HASH, list(range(2 * PS)), PS))
    store.set(a, encode_page(src.layers, 0, fmt, key=a))
    store.set(b, encode_page(src.layers, 1, fmt, key=b))
    return fmt, store, a, b


def test_a_damaged_file_in_storage_is_refused_with_its_reason(tmp_path):
    """The path the engine will take: a file truncated or flipped on disk, read back."""
    fmt, store, a, b = two_stored_pages(tmp_path)
    path = store.path(a)
    path.write_bytes(path.read_bytes()[:-100])
    data = bytearray(store.path(b).read_bytes())
    data[len(data) // 2] ^= 0x10
    store.path(b).write_bytes(bytes(data))
    assert rejected(store.get(a), fmt, a) == "truncated"
    assert rejected(store.get(b), fmt, b) == "checksum"
    assert MAGIC == store.get(b)[:8]


def test_an_intact_page_under_another_pages_key_is_refused(tmp_path):
    """Two pages' files swapped on disk (or a store that mixed up its values): each blob is intact
    and of our format, but holds the KV of other tokens; it is refused, not loaded."""
    fmt, store, a, b = two_stored_pages(tmp_path)
    blob_a, blob_b = store.path(a).read_bytes(), store.path(b).read_bytes()
    store.path(a).write_bytes(blob_b)
    store.path(b).write_bytes(blob_a)
    assert rejected(store.get(a), fmt, a) == "key" and rejected(store.get(b), fmt, b) == "key"
    assert "key" in CORRUPT
    assert decode_page(blob_a, fmt, key=a).tokens == PS  # under its own key it still decodes
