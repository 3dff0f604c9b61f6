"""A lean GGUF reader: the metadata the model needs and each tensor's place, nothing more.

gguf-py's GGUFReader builds a numpy view of every metadata item, the tokenizer's ~100k
strings included, which took seconds for a 135M-parameter file; here a string array is
skipped with one length read per item and kept only as its count (the tokenizer reads its
own metadata once, on a cache miss). Tensor data stays in one read-only memory map.

`dequantize` reads Q8_0 itself, in two numpy passes (~40 ms for the demo model's embedding
table, read at every start; gguf-py's row-group loop took 120–300 ms on the 2-core machine), and
every other type through gguf-py, its reference.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOATS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True)
class Field:
    value: Any  # a scalar, a string, a list of numbers, or None for a skipped string array
    count: int = 1  # items of an array

    def contents(self) -> Any:
        return self.value

    @property
    def data(self) -> range:  # len(field.data): an array's length, as gguf-py's reader gives it
        return range(self.count)


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # as stored: the fastest-varying dimension first
    tensor_type: GGMLQuantizationType
    data_offset: int
    n_bytes: int
    _map: Any

    @property
    def data(self) -> np.ndarray:
        """Raw blocks [rows, bytes per row] (quantized), or the values (float types), without a copy."""
        rows = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        if self.tensor_type in _FLOATS:
            dt = _FLOATS[self.tensor_type]
            count = self.n_bytes // np.dtype(dt).itemsize
            return np.frombuffer(self._map, dt, count, self.data_offset).reshape(tuple(reversed(self.shape)))
        raw = np.frombuffer(self._map, np.uint8, self.n_bytes, self.data_offset)
        return raw.reshape(rows, self.n_bytes // rows)


def dequantize(t: Tensor) -> np.ndarray:
    """t's values as float32, in `t.data`'s shape for a float type (an F32 tensor: a read-only view
    of the file), else [rows, values a row]; the caller reshapes."""
    if t.tensor_type is not GGMLQuantizationType.Q8_0:
        from gguf.quants import dequantize as reference

        return np.asarray(reference(t.data, t.tensor_type), dtype=np.float32)
    block, size = GGML_QUANT_SIZES[t.tensor_type]  # 32 values: a float16 scale, then 32 int8
    raw = t.data.reshape(-1, size)
    scale = raw[:, :2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    out = raw[:, 2:].view(np.int8).astype(np.float32)  # [blocks, 32]
    out *= scale
    return out.reshape(t.data.shape[0], -1)


class GGUFFile:
    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._read("<I") != 0x46554747:  # b"GGUF"
            raise ValueError("no GGUF magic")
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not 2 or 3")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        if n_tensors > 10**7 or n_kv > 10**6:
            raise ValueError(f"implausible counts ({n_tensors} tensors, {n_kv} metadata items)")
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._read("<Q") for _ in range(self._read("<I")))
            infos.append((name, dims, GGMLQuantizationType(self._read("<I")), self._read("<Q")))
        align = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-self._pos // align) * align
        self.tensors = []
        for name, dims, qtype, offset in infos:
            block, size = GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims)) // block * size
            self.tensors.append(Tensor(name, dims, qtype, start + offset, n_bytes, self._map))

    def _read(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._read("<Q")
        if n > len(self._map) - self._pos:
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        s = self._map[self._pos:self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Field:
        if vtype in _SCALARS:
            return Field(self._read(_SCALARS[vtype]))
        if vtype == _STRING:
            return Field(self._string())
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata type {vtype}")
        etype, count = self._read("<I"), self._read("<Q")
        if etype == _STRING:  # the tokenizer's vocabulary and merges: skipped, counted
            length, m, pos = struct.Struct("<Q").unpack_from, self._map, self._pos
            for _ in range(count):
                pos += 8 + length(m, pos)[0]
            self._pos = pos
            if pos > len(m):
                raise ValueError("a string array runs past the end of the file")
            return Field(None, count)
        if etype not in _SCALARS:
            raise ValueError(f"unknown array item type {etype}")
        fmt = _SCALARS[etype]
        size = struct.calcsize(fmt)
        if count * size > len(self._map) - self._pos:
            raise ValueError(f"an array of {count} items runs past the end of the file")
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", self._map, self._pos))
        self._pos += count * size
        return Field(values, count)
