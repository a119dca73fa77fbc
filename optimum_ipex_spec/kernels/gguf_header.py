"""A GGUF file's header: its metadata key-value pairs and its tensor table, read as data (nothing in the file is
executed or unpickled) without reading the tensors.

Layout (GGUF v2/v3, little-endian; ggml's ``docs/gguf.md``): the magic ``GGUF``, a u32 version, u64 tensor and
key-value counts; each key-value pair a string key, a u32 value type and the value; each tensor a string name, a
u32 dimension count, that many u64 dimensions (the row length first), a u32 ggml type and a u64 offset from the
start of the data section, which begins at the next multiple of ``general.alignment`` (32 by default) after the
table. A string is a u64 byte count and UTF-8 bytes; an array a u32 element type, a u64 count and the elements.

gguf-py's ``GGUFReader`` builds a NumPy view per element of every array, so the 151,936-token vocabulary and
151,387 merges of a Qwen2.5 file cost it about 9 s on one core. The tokenizer's arrays are the tokenizer's
business: :func:`read_header` steps over them (keeping their lengths), which reads the same header in well
under a second. The tests compare both readers on every provisioned file.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

#: value type id -> (struct format, width in bytes) for the fixed-width types
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_MAX_NESTING = 4
#: keys whose array values are stepped over (:attr:`GGUFHeader.array_lengths` keeps their lengths)
SKIPPED_ARRAYS = ("tokenizer.",)
#: arrays longer than this are stepped over under any key (a crafted file's array as large as the file would take
#: several times its size as Python objects); the metadata a model's config reads holds a few elements per key
MAX_KEPT_ARRAY = 65536


class GGUFError(ValueError):
    """A GGUF file this package cannot run: not a GGUF file (another magic or version, big-endian), a header that runs
    past the file's end or holds an impossible value, an unsupported architecture or block type, a tensor whose shape
    or byte range does not fit: a truncated or damaged file."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: ``dims`` in the file's order (``dims[0]`` is the row length), the ggml type
    id, and ``offset``: the byte where its data begins, counted from the start of the file."""

    name: str
    dims: Tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class GGUFHeader:
    """What :func:`read_header` found: ``fields`` (key -> int, float, bool, str or list; the arrays of keys under
    :data:`SKIPPED_ARRAYS`, and those longer than :data:`MAX_KEPT_ARRAY`, left out), ``array_lengths`` (key ->
    element count of every array, skipped or not),
    ``tensors`` in the file's order, ``data_offset`` (the byte where the data section begins) and ``alignment``."""

    version: int
    fields: Dict[str, object]
    array_lengths: Dict[str, int]
    tensors: List[TensorInfo]
    data_offset: int
    alignment: int
    size: int = field(default=0)


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, buffer, path: str):
        self.buffer, self.path, self.pos, self.size = buffer, path, 0, len(buffer)

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} at byte {self.pos} of {self.size}: a truncated or damaged GGUF "
                               "file")

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"a value of {n} bytes runs past the end of the file")

    def scalar(self, type_id: int):
        fmt, width = _SCALARS[type_id]
        self.need(width)
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += width
        return value

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        raw = bytes(self.buffer[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8") from None

    def skip_strings(self, count: int) -> None:
        self.need(8 * count)  # each at least its length
        unpack, buffer, pos, size = struct.unpack_from, self.buffer, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail("a string runs past the end of the file")
            pos += 8 + unpack("<Q", buffer, pos)[0]
        if pos > size:
            raise self.fail("a string runs past the end of the file")
        self.pos = pos

    def value(self, type_id: int, keep: bool, depth: int = 0):
        if type_id in _SCALARS:
            return self.scalar(type_id)
        if type_id == _STRING:
            return self.string()
        if type_id != _ARRAY:
            raise self.fail(f"value type {type_id}, which GGUF does not define")
        if depth >= _MAX_NESTING:
            raise self.fail(f"arrays nested more than {_MAX_NESTING} deep")
        element, count = self.u32(), self.u64()
        keep = keep and count <= MAX_KEPT_ARRAY
        if element in _SCALARS:
            width = _SCALARS[element][1]
            self.need(count * width)
            start, self.pos = self.pos, self.pos + count * width
            if not keep:
                return count, None
            values = np.frombuffer(self.buffer, dtype=_NUMPY[element], count=count, offset=start).tolist()
            return count, values
        if element == _STRING and not keep:
            self.skip_strings(count)
            return count, None
        self.need(8 * count)  # a string or a nested array's header takes at least 8 bytes (a string) or 12
        if not keep:
            for _ in range(count):
                self.value(element, False, depth + 1)
            return count, None
        values = [self.value(element, keep, depth + 1) for _ in range(count)]
        if element == _ARRAY:
            values = [inner for _, inner in values]
        return count, values


def read_header(path: os.PathLike) -> GGUFHeader:
    """The header of the GGUF file at ``path`` (module docstring), every length and offset checked against the file's
    size; tensor offsets are not checked against each other or the tensors' byte sizes (that needs the block types:
    :func:`~optimum_ipex_spec.backends.pytorch.gguf_weights.read_gguf`).

    Raises:
        FileNotFoundError: no such file.
        GGUFError: not a GGUF file (another magic), a version other than 2 and 3, a big-endian file, a header
            that runs past the file's end, a duplicated key, a value type GGUF does not define, more than 4
            dimensions, an alignment that is not a power of two.
    """
    path = str(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFError(f"{path} is {size} bytes long: not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            buffer = memoryview(mapped)
            try:
                return _parse(_Cursor(buffer, path), path, len(buffer))
            finally:
                buffer.release()


def _parse(cursor: _Cursor, path: str, size: int) -> GGUFHeader:
    if bytes(cursor.buffer[:4]) != b"GGUF":
        raise GGUFError(f"{path} does not begin with GGUF's magic: not a GGUF file")
    cursor.pos = 4
    version = cursor.u32()
    if version not in (2, 3):
        if version & 0xFFFF == 0 and (version >> 24) in (2, 3):
            raise GGUFError(f"{path} is a big-endian GGUF file; the kernels read little-endian blocks: convert "
                                  "it with gguf-py's gguf-convert-endian")
        raise GGUFError(f"{path} is GGUF version {version}; this reader reads versions 2 and 3")
    tensor_count, kv_count = cursor.u64(), cursor.u64()
    if kv_count * 12 > size or tensor_count * 24 > size:  # each pair and each tensor entry takes at least that
        raise cursor.fail(f"{kv_count} key-value pairs and {tensor_count} tensors cannot fit")
    fields, lengths = {}, {}
    for _ in range(kv_count):
        key = cursor.string()
        if key in fields or key in lengths:
            raise cursor.fail(f"key {key} twice")
        type_id = cursor.u32()
        if type_id == _ARRAY:
            lengths[key], values = cursor.value(type_id, not key.startswith(SKIPPED_ARRAYS))
            if values is not None:
                fields[key] = values
        else:
            fields[key] = cursor.value(type_id, True)
    alignment = fields.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment is {alignment!r}, not a power of two: a damaged file")
    tensors, names = [], set()
    for _ in range(tensor_count):
        name = cursor.string()
        if name in names:
            raise cursor.fail(f"tensor {name} twice")
        names.add(name)
        n_dims = cursor.u32()
        if n_dims > _MAX_DIMS:
            raise cursor.fail(f"tensor {name} with {n_dims} dimensions (ggml has at most {_MAX_DIMS})")
        dims = tuple(cursor.u64() for _ in range(n_dims))
        ggml_type, offset = cursor.u32(), cursor.u64()
        tensors.append(TensorInfo(name, dims, ggml_type, offset))
    data_offset = cursor.pos + (-cursor.pos % alignment)
    tensors = [TensorInfo(t.name, t.dims, t.ggml_type, data_offset + t.offset) for t in tensors]
    return GGUFHeader(version, fields, lengths, tensors, data_offset, alignment, size)
