"""A GGUF file's metadata and tensor table, read once with numpy (no per-element objects).

The ``gguf`` package's reader builds a Python object per array element of every field: a
262,144-token vocabulary (Gemma 3) takes it about 12 s. Here numeric arrays are one
``np.frombuffer`` each and string arrays one pass over their lengths; tensor data is a view
into one read-only memory map, decoded by the ``gguf`` package's dequantizers.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# GGUF value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = range(10)
_UINT64, _INT64, _FLOAT64 = 10, 11, 12
_SCALARS = {
    _UINT8: np.dtype("<u1"),
    _INT8: np.dtype("<i1"),
    _UINT16: np.dtype("<u2"),
    _INT16: np.dtype("<i2"),
    _UINT32: np.dtype("<u4"),
    _INT32: np.dtype("<i4"),
    _FLOAT32: np.dtype("<f4"),
    _BOOL: np.dtype("<u1"),
    _UINT64: np.dtype("<u8"),
    _INT64: np.dtype("<i8"),
    _FLOAT64: np.dtype("<f8"),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file: ``shape`` in PyTorch order (rows first), ``data`` the raw
    bytes (uint8) of its blocks. Invariant: ``data`` views the file's memory map."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    data: np.ndarray

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (every key; arrays as lists, numeric arrays of
    tokenizer scores and types included) and ``tensors`` in file order.

    Invariant: parsing reads each byte of the header once; the tensor bytes are not read
    until a tensor's ``data`` is used. ``ValueError`` for anything that is not a GGUF file
    of version 2 or 3."""

    def __init__(self, path: Path, metadata_only: bool = False) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        buf = np.frombuffer(self._map, dtype=np.uint8)
        self._buf = buf
        self._pos = 0
        try:
            self._parse(metadata_only)
        except (IndexError, ValueError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"cannot read {path}: corrupt or not a GGUF file ({exc})") from None

    # -- primitive reads ----------------------------------------------------------------------
    def _scalar(self, dtype: np.dtype) -> Any:
        end = self._pos + dtype.itemsize
        if end > self._buf.size:
            raise ValueError("truncated header")
        value = self._buf[self._pos : end].view(dtype)[0]
        self._pos = end
        return value.item()

    def _string(self) -> str:
        n = self._scalar(_SCALARS[_UINT64])
        end = self._pos + n
        if end > self._buf.size:
            raise ValueError("truncated string")
        text = bytes(self._map[self._pos : end]).decode("utf-8", errors="replace")
        self._pos = end
        return text

    def _strings(self, count: int) -> list[str]:
        """``count`` length-prefixed strings: one pass, one slice each."""
        mm, pos, out = self._map, self._pos, []
        size = len(mm)
        for _ in range(count):
            n = int.from_bytes(mm[pos : pos + 8], "little")
            pos += 8
            if pos + n > size:
                raise ValueError("truncated string array")
            out.append(mm[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item = self._scalar(_SCALARS[_UINT32])
            count = self._scalar(_SCALARS[_UINT64])
            if item == _STRING:
                return self._strings(count)
            if item in _SCALARS:
                dtype = _SCALARS[item]
                end = self._pos + count * dtype.itemsize
                if end > self._buf.size:
                    raise ValueError("truncated array")
                arr = self._buf[self._pos : end].view(dtype)
                self._pos = end
                return (arr != 0).tolist() if item == _BOOL else arr.tolist()
            return [self._value(item) for _ in range(count)]  # arrays of arrays (rare)
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        value = self._scalar(_SCALARS[vtype])
        return bool(value) if vtype == _BOOL else value

    # -- the file --------------------------------------------------------------------------
    def _parse(self, metadata_only: bool) -> None:
        if bytes(self._map[:4]) != _MAGIC:
            raise ValueError("no GGUF magic")
        self._pos = 4
        version = self._scalar(_SCALARS[_UINT32])
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3)")
        n_tensors = self._scalar(_SCALARS[_UINT64])
        n_kv = self._scalar(_SCALARS[_UINT64])
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(_SCALARS[_UINT32]))
        self.tensors: list[GGUFTensorInfo] = []
        if metadata_only:
            return
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(_SCALARS[_UINT32])
            dims = [self._scalar(_SCALARS[_UINT64]) for _ in range(n_dims)]
            ggml_type = self._scalar(_SCALARS[_UINT32])
            offset = self._scalar(_SCALARS[_UINT64])
            infos.append((name, dims, ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        for name, dims, ggml_type, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            count = int(np.prod(dims)) if dims else 1
            nbytes = count // block * block_bytes
            begin = start + offset
            if begin + nbytes > self._buf.size:
                raise ValueError(f"tensor {name} lies past the end of the file")
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors.append(
                GGUFTensorInfo(name, shape, ggml_type, self._buf[begin : begin + nbytes])
            )

    def release(self, tensor: GGUFTensorInfo) -> None:
        """Drop the file's pages under ``tensor`` from this process's resident set once it
        has been read (they stay in the page cache; a later read faults them back in). A
        loader that releases each tensor after decoding it peaks at what it builds, not at
        what it built plus the whole file it read."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        base = self._buf.__array_interface__["data"][0]
        start = tensor.data.__array_interface__["data"][0] - base
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        end = start + tensor.data.nbytes
        if 0 <= first < end <= len(self._map):
            self._map.madvise(mmap.MADV_DONTNEED, first, end - first)

    def dequantize(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The tensor as float32, in ``tensor.shape``."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(tensor.ggml_type)
        if qtype == GGMLQuantizationType.F32:
            return tensor.data.view(np.float32).reshape(tensor.shape)
        if qtype == GGMLQuantizationType.F16:
            return tensor.data.view(np.float16).astype(np.float32).reshape(tensor.shape)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows = tensor.data.reshape(-1, tensor.shape[-1] // block * block_bytes)
        return np.asarray(dequantize(rows, qtype), dtype=np.float32).reshape(tensor.shape)


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key of the file (the header only)."""
    return GGUFFile(path, metadata_only=True).metadata
