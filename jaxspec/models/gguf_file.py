"""A GGUF file's metadata and tensors, read in one pass over the bytes.

gguf's GGUFReader builds a memmap view per field part, so SmolLM2's 49152 tokens and 48900
merges made its constructor take seconds, and it dequantizes a few rows at a time. Here the metadata is
parsed with struct from one read of the file, and each tensor is dequantized whole by gguf's
block decoders.
"""
from __future__ import annotations

import struct

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOATS = {0: np.float32, 1: np.float16}  # GGML types stored unquantized (BF16, 30, below)


class GGUFFile:
    """metadata: {key: value} (arrays as lists, or numpy arrays for numbers); tensors: {name:
    (ggml type, shape in numpy order, raw bytes)}."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self.buf = memoryview(f.read())
        self.pos = 0
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        self.pos = 4
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self.pos // align) * align
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        self.tensors = {}
        for name, dims, ggml_type, offset in infos:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            nbytes = int(np.prod(dims)) // block * size
            lo = start + offset
            if lo + nbytes > len(self.buf):
                raise ValueError(f"tensor {name} lies past the end of the file")
            raw = np.frombuffer(self.buf[lo:lo + nbytes], np.uint8)
            self.tensors[name] = (ggml_type, tuple(reversed(dims)), raw)

    def _unpack(self, fmt):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def _value(self, kind):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            elem, n = self._unpack("<I"), self._unpack("<Q")
            if elem == _STRING:
                return [self._string() for _ in range(n)]
            if elem in _SCALARS:
                dt = np.dtype(_SCALARS[elem])
                a = np.frombuffer(self.buf[self.pos:self.pos + n * dt.itemsize], dt)
                self.pos += n * dt.itemsize
                return a
            return [self._value(elem) for _ in range(n)]
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        raise ValueError(f"unknown GGUF value type {kind}")

    def tensor(self, name: str) -> np.ndarray | None:
        """The tensor as float32, or None if the file has none of that name."""
        if name not in self.tensors:
            return None
        ggml_type, shape, raw = self.tensors[name]
        if ggml_type in _FLOATS:
            return raw.view(_FLOATS[ggml_type]).astype(np.float32).reshape(shape)
        if ggml_type == 30:  # BF16: the high half of a float32
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        from gguf import quants
        from gguf.constants import GGMLQuantizationType
        codec = getattr(quants, GGMLQuantizationType(ggml_type).name, None)
        if codec is None:
            raise ValueError(f"tensor {name}: GGML type {GGMLQuantizationType(ggml_type).name} is not supported")
        codec.init_grid()  # the IQ types' lookup tables; a no-op for the others
        rows = raw.reshape(-1, raw.size // int(np.prod(shape[:-1])))  # one row of blocks per output row
        return np.asarray(codec.dequantize_rows(rows), np.float32).reshape(shape)
