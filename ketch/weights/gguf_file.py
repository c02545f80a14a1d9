"""A minimal GGUF (v2/v3, little-endian) reader: metadata, tensor table, zero-copy tensor views.

Why not `gguf.GGUFReader`: it wraps every one of the ~100k vocabulary strings in a numpy memmap
slice, which takes ~4 s for a 135M model before a single weight is touched. Parsing with `struct`
over one `mmap` takes a fraction of that. The views handed out have the exact layout
`GGUFReader` gives (typed arrays for plain types, `uint8` rows of blocks for quantized ones), so
`gguf.quants.dequantize` sees the same input either way.

File layout:
    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count    x  (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims] (fastest first), u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32), then tensor data; offsets are relative to it.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
# ggml types stored as plain values; everything else is stored as blocks of bytes.
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy/torch order (slowest first): an HF Linear weight is [out, in]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute offset in the file
    nbytes: int


class GGUFFile:
    """Parsed header of one GGUF file; tensor bytes stay in the page cache until `data()` is read."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            try:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise ValueError(f"not a GGUF file ({e})") from None
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise ValueError(f"truncated or corrupt GGUF header ({type(e).__name__}: {e})") from None

    def data(self, name: str) -> np.ndarray:
        """Read-only view of a tensor's bytes, shaped like `gguf.GGUFReader` shapes `tensor.data`."""
        info = self.tensors[name]
        plain = _PLAIN.get(info.ggml_type)
        if plain is not None:
            count = info.nbytes // np.dtype(plain).itemsize
            return np.frombuffer(self._buf, dtype=plain, count=count, offset=info.offset).reshape(info.shape)
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        rows = info.shape[:-1]
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return raw.reshape(*rows, info.shape[-1] // block * type_size)

    # --- parsing -------------------------------------------------------------------------------

    def _parse(self) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
        buf = self._buf
        if buf[:4] != _MAGIC:
            raise ValueError("not a GGUF file (bad magic bytes)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version & 0xFFFF == 0:
            raise ValueError("big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (need 2 or 3)")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = self._value(pos + 4, vtype)
        raw = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            raw.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = int(metadata.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment}")
        data_start = (pos + alignment - 1) // alignment * alignment
        tensors = {}
        for name, shape, ggml_type, offset in raw:
            info = self._tensor_info(name, shape, ggml_type, data_start + offset)
            if name in tensors:
                raise ValueError(f"duplicate tensor {name!r}")
            tensors[name] = info
        return metadata, tensors

    def _tensor_info(self, name: str, shape: tuple[int, ...], ggml_type: int, offset: int) -> GGUFTensorInfo:
        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown ggml type {ggml_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if not shape or shape[-1] % block:
            raise ValueError(f"tensor {name!r}: shape {shape} does not fit {qtype.name} blocks of {block}")
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
        if offset + nbytes > len(self._buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated download?)")
        return GGUFTensorInfo(name, shape, qtype, offset, nbytes)

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._buf, pos)
        end = pos + 8 + length
        if end > len(self._buf):
            raise struct.error("string runs past the end of the file")
        return self._buf[pos + 8 : end].decode("utf-8"), end

    def _strings(self, pos: int, count: int) -> tuple[list[str], int]:
        """A string array (the vocabulary, the merges: ~100 k strings) in one flat loop: a third
        of the time of a call per item, and the header is parsed up to three times a start-up."""
        buf, unpack, size, items = self._buf, _LENGTH.unpack_from, len(self._buf), []
        append = items.append
        for _ in range(count):
            start = pos + 8
            pos = start + unpack(buf, pos)[0]
            if pos > size:
                raise struct.error("string runs past the end of the file")
            append(buf[start:pos].decode("utf-8"))
        return items, pos

    def _value(self, pos: int, vtype: int) -> tuple[Any, int]:
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            itype, count = struct.unpack_from("<IQ", self._buf, pos)
            pos += 12
            if itype in _NUMPY:  # numeric arrays (token types, scores) in one read
                width = np.dtype(_NUMPY[itype]).itemsize
                if pos + count * width > len(self._buf):
                    raise struct.error("array runs past the end of the file")
                values = np.frombuffer(self._buf, dtype=_NUMPY[itype], count=count, offset=pos).tolist()
                return values, pos + count * width
            if itype == _STRING:
                return self._strings(pos, count)
            items = []
            for _ in range(count):
                item, pos = self._value(pos, itype)
                items.append(item)
            return items, pos
        raise ValueError(f"unknown GGUF metadata value type {vtype}")
