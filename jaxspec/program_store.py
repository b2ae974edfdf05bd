"""Programs kept on disk as exported StableHLO, so that a second start skips tracing and lowering.

JAX's persistent compilation cache skips XLA's compile, but finding an entry needs the lowered
module, and tracing plus lowering an engine's few dozen programs (30 unrolled layers, the
Pallas kernels lowered to Triton and Mosaic GPU) took most of a warm start on the H100
(startup-*.json at 80c2c98: EAGLE-3 lowered for 54.6 s of a 56.3 s warm-up). A program is therefore built by `jax.export`,
written here, and compiled through `Exported.call`: a later start reads the module back, and
lowering that call is a fraction of a second. Cold and warm starts lower the same wrapper, so
the compile of a warm start finds the cold start's entry in the compilation cache.

An entry's name hashes everything the module depends on: jaxspec's source, the jax and jaxlib
versions, the device, the model's and drafter's configs, the program's name, sampler flags and
argument shapes. An unreadable entry is rebuilt.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
import tempfile

import jax
from jax import export

from jaxspec.kv_cache import KVCache
from jaxspec.sampling import SamplingBatch

# the kernels' custom calls: their modules travel inside the exported one, and they are only ever
# read back by the jax and jaxlib that wrote them (both are in the entry's name)
_KERNEL_CALLS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")
_CHECKS = tuple(export.DisabledSafetyCheck.custom_call(t) for t in _KERNEL_CALLS)


def _register_pytrees():
    def no_aux(aux) -> bytes:
        if aux not in ((), None):
            raise TypeError(f"unexpected pytree auxdata {aux!r}")
        return b""

    for cls in (KVCache, SamplingBatch):
        export.register_pytree_node_serialization(cls, serialized_name=f"jaxspec.{cls.__name__}",
                                                  serialize_auxdata=no_aux, deserialize_auxdata=lambda b: ())


_register_pytrees()


@functools.cache
def source_hash() -> str:
    """sha256 of jaxspec's Python source: any edit makes every entry stale."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(__file__))
    for dirpath, dirnames, files in sorted(os.walk(root)):
        dirnames.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                h.update(f.encode())
                with open(os.path.join(dirpath, f), "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def entry_name(*parts) -> str:
    import jaxlib
    dev = jax.devices()[0]
    head = (source_hash(), jax.__version__, jaxlib.__version__, dev.platform, getattr(dev, "device_kind", ""))
    return hashlib.sha256(repr(head + parts).encode()).hexdigest()[:32] + ".jaxexport"


def _load_kernel_runtimes():
    """Importing Mosaic GPU points XLA at its runtime library (MOSAIC_GPU_RUNTIME_LIB_PATH): a
    process that reads its kernels back without lowering one would fail to compile them
    ("Failed to materialize symbols")."""
    if jax.default_backend() == "gpu":
        try:
            importlib.import_module("jax.experimental.mosaic.gpu")
        except ImportError:
            pass


def exported(store: str, name: str, fn, args, kwargs) -> tuple[export.Exported, bool]:
    """fn (a jitted function) exported for args/kwargs: read from the store folder under `name`,
    or built and written there. Returns (Exported, whether it was read)."""
    path = os.path.join(store, name)
    try:
        with open(path, "rb") as f:
            exp = export.deserialize(bytearray(f.read()))
    except Exception:  # noqa: BLE001 - absent, truncated, or from another writer: rebuild it
        pass
    else:
        _load_kernel_runtimes()
        return exp, True
    exp = export.export(fn, disabled_checks=_CHECKS)(*args, **kwargs)
    os.makedirs(store, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=store, suffix=".part")
    with os.fdopen(fd, "wb") as f:
        f.write(exp.serialize())
    os.replace(tmp, path)  # concurrent starts never read a half-written entry
    return exp, False
