"""The XLA options each program compiles with (passed per compile, no process-wide flag): which
GEMMs XLA's Triton emitter gets, and which loops and conditionals run on the device."""
from __future__ import annotations

import importlib.metadata
import os
import sys

import jax

# XLA turns each GPU dot into a Triton GEMM fusion that it generates, autotunes and compiles apiece
# (bench/probes/compile_phases.py: hundreds in one SmolLM2 EAGLE-3 verify program, most of its
# compile). As cuBLAS calls the EAGLE-3 start-up set built in 44.2 s instead of 59.8
# (compile_probe-NVIDIA-H200.json), and cuBLAS was as fast or faster past a few dozen rows but
# slower below (spec-cublas- against spec-tritongemm-NVIDIA-H200.json, MT-bench: EAGLE-3 1.14x at
# batch 8, 128 rows a verify, and 1.04x at 64; 0.86x at batch 1, 32 rows; plain decoding 0.96x at
# batch 8). So programs of more rows than this compile their dots as cuBLAS calls.
TRITON_GEMM_MAX_ROWS = 32


# XLA runs a while loop (a multi-step call) and a conditional (the shared sampler) from the host:
# it reads the condition back every iteration, so launching a decode call blocked the host until
# the call's 8 steps were done, and the host's work between calls left the GPU idle. As command
# buffer commands (CUDA graph conditional nodes) they run on the device: at batch 8 a call then
# returned in 2.1 ms instead of 10.1, its 8 steps took 7.6 ms instead of 9.6, and the Generator
# gave 6832 tok/s instead of 5119 (dispatch_probe-NVIDIA-H200.json, efd8914, 'prog-while' against
# 'default'). A loop or conditional becomes a command only if everything inside it is one
# (XLA's command_buffer_scheduling.cc), and XLA registers its CUB sort (`xla.gpu.ext.cub_sort_*`,
# which its SortRewriter puts in place of a large sort) without the command-buffer trait. The
# batch-1 decode program had one, sorting the vocabulary in the sampler's filter branch
# (cmdbuf_probe-NVIDIA-H200.json), and its launch still waited for the loop (702 against 721
# tok/s). XLA's own sort (a command) fixed that: plain decoding at batch 1 went from 696 to 799
# tok/s, but the greedy EAGLE-3 verify program, whose loop converted either way, lost 10% with it
# (1565 against 1421 tok/s; spec-cub1- against spec-cub0-NVIDIA-H200.json, one machine, MT-bench).
# So only the programs that loop over the shared sampler (`decode`, the rollout's loop) take XLA's
# sort; the rest keep CUB's. None: XLA's default.
# COLLECTIVES (a tensor-parallel loop's all-reduces as commands, so that the loop could be one too)
# fails on two H100s: "Failed to instantiate CUDA graph: CUDA_ERROR_INVALID_VALUE" (jax 0.11.2),
# under either update mode and with XLA's one-shot all-reduce kernel too (tp_step-*.json as
# committed in 63f9af0). So a TP decode loop runs from the host (programs.py's shared_sampler).
COMMAND_BUFFERS: str | None = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
if os.environ.get("JAXSPEC_COMMAND_BUFFERS") is not None:  # probes: "" turns them off (a profile then sees each kernel)
    COMMAND_BUFFERS = os.environ["JAXSPEC_COMMAND_BUFFERS"] or None
XLA_SORT_PROGRAMS = ("decode",)

# XLA re-records a program's command buffer before a launch whenever a buffer its commands use
# moved since its last launch (command_buffer_thunk.cc). A chained call is launched while the last
# call's outputs are still held (the host reads them next), so its outputs land elsewhere: every
# engine call was re-recorded, 1.4 ms of host time a call at batch 1 and 2.8 ms at batch 8 for
# EAGLE-3 (launch_trace-NVIDIA-H100-80GB-HBM3.json). Two loaded copies of each program used in turn
# did not help: the outputs still moved about once a call (launch_trace-twins-*.json) and EAGLE-3
# with them ran 0.97x its speed without (spec-steps-*.json); that code is gone (git history, c21d56d).
# Most of the re-recording came from the programs' temporary buffer, not their arguments: XLA's
# SKIP_TEMP mode (jaxlib >= 0.11.2; the VMM allocator) gives it a stable virtual address, and only
# the commands that touch a moved argument or output are re-recorded. EAGLE-3, random weights:
# 0.47 ms of updates a call instead of 1.70 at batch 1 and 0.54 instead of 5.36 at batch 8, where a
# call took 7.9 ms instead of 11.4 (launch_trace-mode-SKIP_TEMP- against -mode-default-*.json).
# Through the Generator (real weights) the change was within noise (spec-mode-*.json).
# The GPU client reads XLA_FLAGS once, as it starts: request_stable_temps() adds the flag before.
# JAXSPEC_CMDBUF_UPDATE_MODE="" leaves XLA's default (ALWAYS_UPDATE). Training keeps the default:
# `python -m jaxspec.train` under SKIP_TEMP died (SIGSEGV) in its first orbax checkpoint save, twice,
# and ran through with the flag off (session 57, H100, jaxlib 0.11.2; the stage-4 head's card).
CMDBUF_UPDATE_MODE = os.environ.get("JAXSPEC_CMDBUF_UPDATE_MODE", "SKIP_TEMP")
DEFAULT_MODE_ENTRIES = ("jaxspec.train",)  # `python -m` entry points that keep XLA's default mode
_MODE_FLAG = "--xla_gpu_command_buffer_update_mode"


def _version(dist: str) -> tuple | None:
    try:
        return tuple(int(x) for x in importlib.metadata.version(dist).split(".")[:3])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def request_stable_temps() -> bool:
    """Add CMDBUF_UPDATE_MODE to XLA_FLAGS where a CUDA plugin and a jaxlib that knows the flag are
    installed (an older XLA aborts on it) and no JAX backend has started yet. Whether the flag is set."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _MODE_FLAG in flags:
        return True
    if not CMDBUF_UPDATE_MODE or (_version("jaxlib") or (0,)) < (0, 11, 2):
        return False
    if _started_as(DEFAULT_MODE_ENTRIES):
        return False
    if not any(_version(d) for d in ("jax-cuda12-plugin", "jax-cuda13-plugin")):
        return False
    try:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {_MODE_FLAG}={CMDBUF_UPDATE_MODE}".strip()
    return True


def _started_as(modules) -> bool:
    """Whether this process is `python -m <one of modules>` (jaxspec's __init__ runs before the
    module does, while sys.argv[0] is still '-m': the interpreter's own argv tells)."""
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b in modules for a, b in zip(argv, argv[1:]))


def update_mode() -> str:
    """The command-buffer update mode XLA_FLAGS asks for ('default': XLA's own, ALWAYS_UPDATE)."""
    return os.environ.get("XLA_FLAGS", "").partition(_MODE_FLAG + "=")[2].split(" ")[0] or "default"


request_stable_temps()  # at import: jaxspec imports this module before it runs anything


def loop_options(xla_sort: bool = True) -> dict | None:
    """XLA options that keep a program's loops and conditionals on the device (COMMAND_BUFFERS);
    xla_sort: sorts as XLA's own kernels, which a command buffer can hold, instead of CUB's."""
    if jax.default_backend() != "gpu" or not COMMAND_BUFFERS:
        return None
    return {"xla_gpu_enable_command_buffer": COMMAND_BUFFERS, "xla_gpu_enable_cub_radix_sort": not xla_sort}


def program_options(name: str, args) -> dict | None:
    """XLA options the program `name` compiles with, by the token rows of its first argument."""
    if jax.default_backend() != "gpu":
        return None
    rows = int(args[0].shape[0]) * int(args[0].shape[1])
    opts = {} if rows <= TRITON_GEMM_MAX_ROWS else {"xla_gpu_enable_triton_gemm": False}
    return dict(opts, **(loop_options(name in XLA_SORT_PROGRAMS) or {})) or None
