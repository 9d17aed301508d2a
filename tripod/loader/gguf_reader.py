"""A fast GGUF reader: metadata and tensor views, parsed lazily where it matters.

``gguf.GGUFReader`` parses every metadata value up front, element by element through numpy memmap
slices: the 49k-token vocabulary and 49k merges of the embedded model take ~3.5 s, in every
process that opens the file (the server's HTTP process and its engine process, each replica of a
fleet). This reader walks the same layout with ``struct`` and keeps large arrays as byte ranges
decoded only when asked for, so opening a file costs milliseconds. It exposes the subset of the
``GGUFReader`` interface tripod uses: ``fields[key].contents()`` and ``tensors`` (``name``,
``shape`` in GGUF order, ``tensor_type``, ``n_elements``, ``data`` as read-only numpy views shaped as
``GGUFReader`` shapes them).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
          GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
          GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
          GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64}
_PLAIN_TENSORS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


class Field:
    """One metadata value; large arrays are decoded on the first ``contents()``."""

    __slots__ = ("_decode", "_value")

    def __init__(self, decode: Callable[[], Any] | None = None, value: Any = None) -> None:
        self._decode = decode
        self._value = value

    def contents(self) -> Any:
        if self._decode is not None:
            self._value, self._decode = self._decode(), None
        return self._value


@dataclass(slots=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # GGUF order (innermost first), as GGUFReader gives it
    tensor_type: GGMLQuantizationType
    n_elements: int
    data: np.ndarray  # read-only view: numpy order; quantized types as bytes per row


class GGUFMetadataReader:
    """Owns a read-only memory map of one GGUF file (v2 or v3)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after close
        self._mv = memoryview(self._mm)  # what struct reads from
        self.buf: np.ndarray = np.frombuffer(self._mm, dtype=np.uint8)  # what tensor views are cut from
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._mv, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        off = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key, off = self._string(off)
            (vtype,) = struct.unpack_from("<I", self._mv, off)
            self.fields[key], off = self._value(off + 4, vtype)
        infos = []
        for _ in range(n_tensors):
            name, off = self._string(off)
            (n_dims,) = struct.unpack_from("<I", self._mv, off)
            dims = struct.unpack_from(f"<{n_dims}Q", self._mv, off + 4)
            ttype, t_off = struct.unpack_from("<IQ", self._mv, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(ttype), t_off))
        align_field = self.fields.get("general.alignment")
        align = int(align_field.contents()) if align_field is not None else 32
        start = off + (-off % align)
        self.tensors = [self._tensor(name, dims, ttype, start + t_off) for name, dims, ttype, t_off in infos]

    def _string(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._mv, off)
        return bytes(self.buf[off + 8 : off + 8 + n]).decode("utf-8", errors="replace"), off + 8 + n

    def _value(self, off: int, vtype: int) -> tuple[Field, int]:
        if vtype in _SCALARS:
            (v,) = struct.unpack_from(_SCALARS[vtype], self._mv, off)
            return Field(value=v), off + struct.calcsize(_SCALARS[vtype])
        if vtype == GGUFValueType.STRING:
            s, end = self._string(off)
            return Field(value=s), end
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {off}")
        itype, count = struct.unpack_from("<IQ", self._mv, off)
        off += 12
        if itype in _NUMPY:
            arr: np.ndarray = np.frombuffer(self.buf, dtype=_NUMPY[itype], count=count, offset=off)
            return Field(lambda: arr.tolist()), off + arr.nbytes
        if itype == GGUFValueType.STRING:
            start = off
            for _ in range(count):  # only the lengths are read now
                (n,) = struct.unpack_from("<Q", self._mv, off)
                off += 8 + n
            return Field(lambda: self._strings(start, count)), off
        items = []  # nested arrays (rare): decoded now
        for _ in range(count):
            item, off = self._value(off, itype)
            items.append(item)
        return Field(lambda: [i.contents() for i in items]), off

    def _strings(self, off: int, count: int) -> list[str]:
        out = []
        for _ in range(count):
            s, off = self._string(off)
            out.append(s)
        return out

    def _tensor(self, name: str, dims: tuple[int, ...], ttype: GGMLQuantizationType, off: int) -> Tensor:
        n = int(np.prod(dims)) if dims else 1
        np_dims = tuple(reversed(dims))
        if ttype in _PLAIN_TENSORS:
            data = np.frombuffer(self.buf, dtype=_PLAIN_TENSORS[ttype], count=n, offset=off).reshape(np_dims)
        else:
            block, size = GGML_QUANT_SIZES[ttype]
            data = np.frombuffer(self.buf, dtype=np.uint8, count=n * size // block, offset=off)
            data = data.reshape(quant_shape_to_byte_shape(np_dims, ttype))
        return Tensor(name, dims, ttype, n, data)
