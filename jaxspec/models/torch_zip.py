"""Read a `torch.save` state dict (pytorch_model.bin) into numpy without importing torch.

The file is a zip: `*/data.pkl` pickles the dict, each tensor a `_rebuild_tensor_v2(storage,
offset, size, stride, ...)` whose storage is a raw little-endian buffer `*/data/<key>`. Only those
few globals are honoured; anything else in the pickle is refused, so a checkpoint cannot run code.
"""
from __future__ import annotations

import collections
import pickle
import zipfile

import ml_dtypes
import numpy as np

_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, dtype):
        self.dtype = dtype


def _rebuild_tensor(storage, offset, size, stride, *_):
    itemsize = storage.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride)).copy()


def _rebuild_parameter(data, *_):
    return data


class _Unpickler(pickle.Unpickler):
    def __init__(self, fh, zf, prefix):
        super().__init__(fh)
        self.zf, self.prefix = zf, prefix

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint")

    def persistent_load(self, pid):
        kind, stype, key = pid[0], pid[1], pid[2]
        if kind != "storage" or not isinstance(stype, _StorageType):
            raise pickle.UnpicklingError(f"unsupported storage {pid!r}")
        raw = self.zf.read(f"{self.prefix}/data/{key}")
        return np.frombuffer(raw, dtype=stype.dtype)


def _unpickle(path: str):
    from jaxspec.models.loading import CheckpointError
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")]
            if not pkl:
                raise CheckpointError(f"{path}: not a torch.save zip archive (no data.pkl)")
            prefix = pkl[0][:-len("/data.pkl")]
            with zf.open(pkl[0]) as fh:
                return _Unpickler(fh, zf, prefix).load()
    except zipfile.BadZipFile:
        raise CheckpointError(f"{path}: not a zip archive; legacy (pre-1.6) torch files are not supported") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: {e}") from None


def read_torch_zip(path: str) -> dict:
    from jaxspec.models.loading import CheckpointError
    state = _unpickle(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return {k: (v.astype(np.float32) if v.dtype == ml_dtypes.bfloat16 else v) for k, v in state.items()}


def read_torch_tensor(path: str) -> np.ndarray:
    """A file written by `torch.save(tensor)` (SGLang's token maps), as numpy."""
    from jaxspec.models.loading import CheckpointError
    value = _unpickle(path)
    if not isinstance(value, np.ndarray):
        raise CheckpointError(f"{path}: holds a {type(value).__name__}, not a tensor")
    return value
