"""The GGUF container: metadata and tensor headers parsed from a memory map, every read bounds-checked.

gguf's own GGUFReader makes numpy views for each of the ~150,000 values of a vocabulary (about a second for a
small model) and reports hostile headers as whatever numpy raised. This parser reads the same format (versions 2
and 3, little-endian) with ``struct`` in one pass, refuses any count or length the rest of the file cannot hold
before it loops or allocates, and names the offending key or tensor. Storage-type constants (block sizes) and
dequantizers still come from the gguf package.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ARRAY_NESTING = 2

# GGUF value types: (struct format, size) of scalars; 8 is a string, 9 an array.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """What is wrong with the file, naming the key or tensor; the reader adds the path."""


@dataclass(frozen=True, slots=True)
class TensorHeader:
    name: str
    dims: tuple[int, ...]  # GGUF order: fastest-varying first
    storage_type: gguf.GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[TensorHeader]
    data: np.ndarray  # uint8 view of the whole file's memory map

    def tensor_bytes(self, header: TensorHeader) -> np.ndarray:
        return self.data[header.offset:header.offset + header.nbytes]


def read_gguf(path: Path) -> GGUFFile:
    """Parse ``path``; raises GGUFFormatError for anything the format or the file's size rules out."""
    with path.open("rb") as f:
        if path.stat().st_size == 0:
            raise GGUFFormatError("empty file")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapped, dtype=np.uint8)
    parser = _Parser(memoryview(mapped))
    if parser.take(4) != MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic)")
    version = parser.u32()
    if version not in VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFFormatError(f"unsupported GGUF version {version}{hint}")
    tensor_count, kv_count = parser.u64(), parser.u64()
    # The smallest key/value (empty key, one byte) is 13 bytes, the smallest tensor header 24.
    parser.expect_room(kv_count * 13 + tensor_count * 24, f"{kv_count} metadata values and {tensor_count} tensors")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = parser.string("a metadata key")
        if key in metadata:
            raise GGUFFormatError(f"metadata key {key!r} appears twice")
        metadata[key] = parser.value(parser.u32(), key, depth=0)
    headers = [parser.tensor_header() for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment!r}")
    start = -(-parser.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, type_id, relative in headers:
        if name in names:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        if relative % alignment:  # what llama.cpp checks too: blocks are read in place, aligned
            raise GGUFFormatError(f"tensor {name!r}: its offset {relative} is not a multiple of the file's alignment "
                                  f"({alignment}, general.alignment), as GGUF requires")
        names.add(name)
        tensors.append(_locate(name, dims, type_id, start + relative, len(data)))
    return GGUFFile(metadata, tensors, data)


def _locate(name: str, dims: tuple[int, ...], type_id: int, offset: int, file_size: int) -> TensorHeader:
    def fail(why: str) -> GGUFFormatError:
        return GGUFFormatError(f"tensor {name!r}: {why}")

    if not 1 <= len(dims) <= MAX_DIMS or any(d <= 0 for d in dims):
        raise fail(f"invalid dimensions {list(dims)}")
    try:
        storage_type = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise fail(f"unknown GGML storage type {type_id}") from None
    block_size, type_size = gguf.GGML_QUANT_SIZES[storage_type]
    if dims[0] % block_size:
        raise fail(f"row length {dims[0]} is not a multiple of {storage_type.name}'s block of {block_size}")
    elements = 1
    for d in dims:
        elements *= d
    nbytes = elements // block_size * type_size
    if offset + nbytes > file_size:
        raise fail(f"its {nbytes} bytes at offset {offset} lie outside the file ({file_size} bytes)")
    return TensorHeader(name, dims, storage_type, offset, nbytes)


class _Parser:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.pos = 0

    def expect_room(self, nbytes: int, what: str) -> None:
        if nbytes > len(self.buffer) - self.pos:
            raise GGUFFormatError(f"truncated: {what} need {nbytes} bytes at offset {self.pos}, the file has "
                                  f"{len(self.buffer) - self.pos} left")

    def take(self, nbytes: int) -> memoryview:
        self.expect_room(nbytes, "the next field")
        chunk = self.buffer[self.pos:self.pos + nbytes]
        self.pos += nbytes
        return chunk

    def u32(self) -> int:
        self.expect_room(4, "a 32-bit field")
        value = _U32.unpack_from(self.buffer, self.pos)[0]
        self.pos += 4
        return value

    def u64(self) -> int:
        self.expect_room(8, "a 64-bit field")
        value = _U64.unpack_from(self.buffer, self.pos)[0]
        self.pos += 8
        return value

    def string(self, what: str) -> str:
        length = self.u64()
        self.expect_room(length, f"{what} of {length} bytes")
        try:
            text = str(self.buffer[self.pos:self.pos + length], "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{what} is not UTF-8: {e}") from None
        self.pos += length
        return text

    def value(self, value_type: int, key: str, depth: int) -> Any:
        if value_type in _SCALARS:
            fmt, size = _SCALARS[value_type]
            self.expect_room(size, f"the value of {key!r}")
            value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
            self.pos += size
            return value
        if value_type == _STRING:
            return self.string(f"the value of {key!r}")
        if value_type != _ARRAY:
            raise GGUFFormatError(f"metadata {key!r} has unknown value type {value_type}")
        if depth >= MAX_ARRAY_NESTING:
            raise GGUFFormatError(f"metadata {key!r} nests arrays deeper than {MAX_ARRAY_NESTING}")
        item_type, count = self.u32(), self.u64()
        if item_type in _NUMPY:
            size = _SCALARS[item_type][1]
            self.expect_room(count * size, f"the {count} values of {key!r}")
            items = np.frombuffer(self.buffer, dtype=_NUMPY[item_type], count=count, offset=self.pos).tolist()
            self.pos += count * size
            return items
        self.expect_room(count * 8, f"the {count} values of {key!r}")  # each at least a length or a header
        if item_type == _STRING:
            return self.strings(count, key)
        return [self.value(item_type, key, depth + 1) for _ in range(count)]

    def strings(self, count: int, key: str) -> list[str]:
        """``count`` strings in one loop: a vocabulary has ~100,000 of them."""
        buffer, pos, end, out = self.buffer, self.pos, len(self.buffer), []
        unpack = _U64.unpack_from
        try:
            for _ in range(count):
                if pos + 8 > end:
                    raise GGUFFormatError(f"truncated: the strings of {key!r} run past the end of the file")
                length = unpack(buffer, pos)[0]
                pos += 8
                if length > end - pos:
                    raise GGUFFormatError(f"truncated: a string of {key!r} of {length} bytes runs past the end")
                out.append(str(buffer[pos:pos + length], "utf-8"))
                pos += length
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"a string of {key!r} is not UTF-8: {e}") from None
        self.pos = pos
        return out

    def tensor_header(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string("a tensor name")
        n_dims = self.u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions; at most {MAX_DIMS} are allowed")
        dims = tuple(self.u64() for _ in range(n_dims))
        return name, dims, self.u32(), self.u64()
