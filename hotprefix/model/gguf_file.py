"""A lean GGUF reader: scalar metadata and the tensor table, arrays skipped.

gguf-py's GGUFReader decodes every metadata field element by element (the
tokenizer's ~100k vocabulary and merge strings), which takes seconds; the
engine needs a few scalars and the tensors. Arrays are skipped by length here
and can be decoded on demand. Tensor data is a memory map, as raw bytes shaped
[rows, bytes per row], which gguf.quants.dequantize accepts for every type.

The map is private and writable (copy-on-write), so that torch tensors can view it
without a copy; nothing writes to it, so every page stays the page cache's.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4  # GGML_MAX_DIMS


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class ArrayField:
    """An array left undecoded: element type, count, and where its items start."""

    item_type: int
    count: int
    offset: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost (row length) first
    ggml_type: int
    offset: int  # absolute, in the file

    @property
    def rows_cols(self) -> tuple[int, int]:
        cols = self.shape[0]
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1, cols


class GGUFFile:
    """Parse the header of a GGUF file. Raises GGUFFormatError for a file that is not GGUF."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="c")
        self.buf = memoryview(self.data)
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GGUFFormatError(f"truncated or corrupt GGUF header ({e})") from None

    def _unpack(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def _skip(self, vtype: int, count: int) -> None:
        if vtype == _STRING:
            for _ in range(count):
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        elif vtype == _ARRAY:
            for _ in range(count):
                inner, n = struct.unpack_from("<IQ", self.buf, self.pos)
                self.pos += 12
                self._skip(inner, n)
        elif vtype in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[vtype]) * count
        else:
            raise GGUFFormatError(f"unknown metadata value type {vtype}")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            inner, n = self._unpack("<I"), self._unpack("<Q")
            field = ArrayField(inner, n, self.pos)
            self._skip(inner, n)
            return field
        raise GGUFFormatError(f"unknown metadata value type {vtype}")

    def _parse(self) -> None:
        if bytes(self.buf[:4]) != b"GGUF":
            raise GGUFFormatError("not a GGUF file (bad magic)")
        self.pos = 4
        self.version = self._unpack("<I")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        self.spans: dict[str, tuple[int, int]] = {}  # key -> where its key-value record lies in the file
        for _ in range(n_kv):
            start = self.pos
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
            self.spans[key] = (start, self.pos)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
            shape = tuple(self._unpack("<Q") for _ in range(n_dims))
            infos.append((name, shape, self._unpack("<I"), self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = (self.pos + align - 1) // align * align
        self.tensors = [TensorInfo(n, s, t, start + off) for n, s, t, off in infos]

    def digest(self, prefixes: tuple[str, ...]) -> str:
        """A digest of the metadata records (key, type, value as stored) whose keys start
        with one of `prefixes`, in key order: the same for two files that store the same
        values."""
        h = hashlib.sha256()
        for key in sorted(k for k in self.spans if k.startswith(prefixes)):
            start, end = self.spans[key]
            h.update(self.buf[start:end])
        return h.hexdigest()

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def array_len(self, key: str) -> int | None:
        f = self.fields.get(key)
        return f.count if isinstance(f, ArrayField) else None

    def scalars(self, key: str) -> list[Any] | None:
        """The items of an array of scalars (numbers, booleans), or None for a key that
        is not one."""
        f = self.fields.get(key)
        if not isinstance(f, ArrayField) or f.item_type not in _SCALARS:
            return None
        fmt = _SCALARS[f.item_type]
        return list(np.frombuffer(self.buf, dtype=np.dtype(fmt), count=f.count, offset=f.offset).tolist())

    def raw(self, t: TensorInfo, type_size: int, block_size: int) -> np.ndarray:
        """The tensor's bytes as [rows, bytes per row] (a view of the memory map).
        Raises GGUFFormatError for a row length its blocks do not divide or data past
        the end of the file (a truncated download)."""
        rows, cols = t.rows_cols
        if cols <= 0 or rows <= 0 or cols % block_size:
            raise GGUFFormatError(f"tensor {t.name!r} has shape {t.shape}, not whole blocks of {block_size}")
        row_bytes = cols // block_size * type_size
        end = t.offset + rows * row_bytes
        if end > len(self.data):
            raise GGUFFormatError(f"tensor {t.name!r} ends at byte {end:,}, past the end of the file "
                                  f"({len(self.data):,} bytes): truncated?")
        return self.data[t.offset:end].reshape(rows, row_bytes)

    def release(self) -> None:
        """Drop the mapped pages from this process (they stay in the page cache and come
        back on the next read): after the tensors were copied or regrouped, the resident
        set holds only what is read again (embedding rows). Only views that are read, never
        written, may point into the map (a page written would be copied, and dropped here)."""
        m = getattr(self.data, "_mmap", None)
        if m is not None and hasattr(m, "madvise"):
            m.madvise(mmap.MADV_DONTNEED)
