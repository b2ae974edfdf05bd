"""Programs kept on disk, so that a second start skips tracing, lowering and compiling: each as
exported StableHLO and, once compiled, as the executable itself.

JAX's persistent compilation cache skips XLA's compile, but finding an entry needs the lowered
module, and tracing plus lowering an engine's few dozen programs (30 unrolled layers, the
Pallas kernels lowered to Triton and Mosaic GPU) took most of a warm start on the H100
(startup-*.json at 80c2c98: EAGLE-3 lowered for 54.6 s of a 56.3 s warm-up). A program is therefore built by `jax.export`,
written here, and compiled through `Exported.call`: a later start reads the module back, and
lowering that call is a fraction of a second. Cold and warm starts lower the same wrapper, so
the compile of a warm start finds the cold start's entry in the compilation cache.

The executable goes one step further: a start that finds it loads it as it is, with no module
to lower and no cache key to compute (finding 22 EAGLE-3 programs in the compilation cache took
4.7 s of a 10.1 s warm start on the H200: startup-NVIDIA-H200.json at 0091df7). Its name adds the
compile options, XLA_FLAGS and the backend's platform version (the CUDA runtime) to the entry's.

An entry's name hashes everything the module depends on: jaxspec's source, the jax and jaxlib
versions, the device, the model's and drafter's configs, the program's name, sampler flags and
argument shapes. An unreadable entry is rebuilt. (Executables are pickled: the store is the
user's own cache folder, read by nobody else.)

Also here: the switch of JAX's persistent compilation cache and the count of executables built.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
import pickle
import tempfile
import threading

import jax
from jax import export
from jax.experimental import serialize_executable

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


def executable_name(entry: str, options: dict | None) -> str:
    """The store's file name for `entry` compiled with `options` under this process's XLA flags."""
    dev = jax.devices()[0]
    key = (entry, sorted((options or {}).items()), os.environ.get("XLA_FLAGS", ""), dev.client.platform_version)
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".xlaexe"


def load_executable(store: str, name: str):
    """The compiled program kept under `name`, loaded onto the device; None when it is absent or
    unreadable (the caller compiles it again)."""
    path = os.path.join(store, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
        _load_kernel_runtimes()
        # the programs run on one device (a mesh's programs are not stored)
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                         execution_devices=jax.devices()[:1])
    except Exception:  # noqa: BLE001 - truncated, or written by another runtime
        return None


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache (its keys hold the program, the jax version, the
    backend and the XLA flags, so an entry never serves another configuration). path: a folder,
    'off', or None for $JAXSPEC_CACHE_DIR or ~/.cache/jaxspec/xla. A folder set through
    JAX_COMPILATION_CACHE_DIR or jax.config is kept. Returns the folder in use."""
    from jax.experimental.compilation_cache import compilation_cache
    current = jax.config.jax_compilation_cache_dir
    path = path or os.environ.get("JAXSPEC_CACHE_DIR")
    if current and path is None:
        return current
    if path != "off":
        path = path or os.path.join(os.path.expanduser("~"), ".cache", "jaxspec", "xla")
        os.makedirs(path, exist_ok=True)
    new = None if path == "off" else path
    if new != current:
        jax.config.update("jax_compilation_cache_dir", new)
        compilation_cache.reset_cache()  # JAX decides once whether to use it: make it decide again
    return new


_COMPILES = [0]


def _count_compiles(event, *_, **__):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def compile_count() -> int:
    """Executables this process has built so far (fresh or from the persistent cache), any program."""
    return _COMPILES[0]


_THREAD = threading.local()


def _note_cache_hit(event, **_):
    if event == "/jax/compilation_cache/cache_hits":  # recorded in the thread that compiles
        _THREAD.cache_hit = True


jax.monitoring.register_event_listener(_note_cache_hit)


def compile_lowered(lowered, options):
    """(executable, whether XLA built it here). An executable that JAX's persistent cache supplied
    does not always serialize whole (on the CPU, its functions went missing when loaded again),
    so only one built here is kept."""
    _THREAD.cache_hit = False
    exe = lowered.compile(options)
    return exe, not _THREAD.cache_hit


def save_executable(store: str, name: str, compiled) -> None:
    try:
        data = pickle.dumps(serialize_executable.serialize(compiled))
    except Exception:  # noqa: BLE001 - a backend that cannot serialize it: the compilation cache still serves
        return
    _write(store, name, data)


def _write(store: str, name: str, data: bytes) -> None:
    os.makedirs(store, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=store, suffix=".part")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(store, name))  # concurrent starts never read a half-written entry


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
    _write(store, name, exp.serialize())
    return exp, False
