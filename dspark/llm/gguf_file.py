"""A GGUF file's metadata and tensor table, read with every count bounded by the file's size.

The ``gguf`` package's reader wraps each value in numpy views: a 262,144-token vocabulary
(Gemma 3) takes it 9-14 s and a hostile count (2**40 strings) an IndexError after a long loop.
This reader walks the same layout (GGUF v2/v3: header, typed key/values, tensor infos,
aligned data) with plain ``struct`` reads over a memory map, checks each length against the
bytes left before it reads or loops, and returns tensors as numpy views of the map in the form
``gguf.quants.dequantize`` takes (the package's own type tables and dequantization stay in use).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.errors import ConfigError

MAGIC = b"GGUF"
MAX_DIMS = 4
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: (out, in) for a matrix
    type_name: str          # GGML type, e.g. "Q4_K"
    type_id: int
    data: np.ndarray        # F32/F16 as typed arrays of ``shape``; others uint8 [rows, row bytes]


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str):
        raise ConfigError("gguf", f"not a readable GGUF file ({what} at byte {self.pos})", self.path)

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self.size - self.pos:
            self.fail(f"{what} runs past the end of the file")
        view = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, kind: int, what: str):
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(10, what)
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")

    def value(self, kind: int, what: str):
        if kind in _SCALARS:
            return self.scalar(kind, what)
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            self.fail(f"{what} has unknown value type {kind}")
        item, count = self.scalar(4, what), self.scalar(10, what)
        if item in _NUMPY:
            width = np.dtype(_NUMPY[item]).itemsize
            if count > (self.size - self.pos) // width:
                self.fail(f"{what}: {count} items run past the end of the file")
            return np.frombuffer(self.take(count * width, what), _NUMPY[item]).tolist()
        if item == _STRING:
            if count > (self.size - self.pos) // 8:  # each string has at least its 8-byte length
                self.fail(f"{what}: {count} strings run past the end of the file")
            return [self.string(what) for _ in range(count)]
        self.fail(f"{what}: arrays of type {item} are not read")


def read_gguf(path: Path) -> tuple[dict, dict[str, TensorInfo], mmap.mmap]:
    """(metadata by key, tensors by name, the map they view) of a GGUF file; a ConfigError
    naming the file and the byte for anything that is not a well-formed GGUF."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise ConfigError("gguf", "not a readable GGUF file (empty)", path) from None
    c = _Cursor(buf, path)
    if bytes(c.take(4, "magic")) != MAGIC:
        c.fail("no GGUF magic")
    version = c.scalar(4, "version")
    if version not in (2, 3):
        c.fail(f"GGUF version {version}, expected 2 or 3")
    n_tensors, n_kv = c.scalar(10, "tensor count"), c.scalar(10, "metadata count")
    if n_kv > c.size // 13 or n_tensors > c.size // 24:  # the smallest key/value and tensor info
        c.fail(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in {c.size} bytes")
    fields = {}
    for _ in range(n_kv):
        key = c.string("metadata key")
        fields[key] = c.value(c.scalar(4, key), key)
    infos = []
    for _ in range(n_tensors):
        name = c.string("tensor name")
        n_dims = c.scalar(4, name)
        if not 1 <= n_dims <= MAX_DIMS:
            c.fail(f"tensor {name} has {n_dims} dimensions")
        dims = [c.scalar(10, name) for _ in range(n_dims)]
        kind, offset = c.scalar(4, name), c.scalar(10, name)
        infos.append((name, dims, kind, offset))
    alignment = fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        c.fail(f"general.alignment {alignment!r} is not a power of two")
    start = -(-c.pos // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ConfigError(name, f"unknown GGML type {kind}", path) from None
        if any(d < 1 or d > c.size for d in dims) or dims[0] % block:
            raise ConfigError(name, f"dimensions {dims} do not fit a {qtype.name} tensor in this file", path)
        if offset % alignment:  # GGUF aligns every tensor's data; the kernels read it as aligned blocks
            raise ConfigError(name, f"data offset {offset} is not a multiple of general.alignment ({alignment}): "
                              "the tensor table is damaged (its data would be read from the wrong bytes)", path)
        elements = int(np.prod(dims, dtype=np.float64))
        nbytes = elements // block * type_size
        begin = start + offset
        if elements > c.size * block or begin + nbytes > c.size:
            raise ConfigError(name, f"{nbytes} bytes at offset {offset} run past the end of the file", path)
        shape = tuple(reversed(dims))
        if qtype.name in ("F32", "F16"):
            data = np.frombuffer(buf, np.float32 if qtype.name == "F32" else np.float16, elements, begin).reshape(shape)
        else:
            rows = elements // dims[0]
            data = np.frombuffer(buf, np.uint8, nbytes, begin).reshape(rows, nbytes // rows)
        if name in tensors:
            raise ConfigError(name, "tensor appears twice in the file", path)
        tensors[name] = TensorInfo(name, shape, qtype.name, kind, data)
    return fields, tensors, buf
