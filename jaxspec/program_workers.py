"""A cold start's program set built by several processes at once.

Tracing and lowering a program is Python work that threads cannot share (the GIL): on the H100
the EAGLE-3 engine's 32 programs lowered for 69 s of a 105 s cold warm-up (startup-*.json at 80c2c98). So
when the store (program_store.py) lacks many of an engine's programs, worker processes each
export and compile a share of them from the programs' recipe (graph definitions and weight
shapes, no weights) into the store and JAX's compilation cache; the engine then reads every
program back as on a warm start.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import warnings

import jax
import numpy as np


def default_workers(missing: int) -> int:
    """Processes for `missing` programs: none for a few, or on a machine without cores to spare
    (each worker compiles in threads too)."""
    if missing < 8:
        return 0
    return max(0, min(4, (os.cpu_count() or 1) // 4, missing // 4))


def build(groups, specs, workers: int) -> int:
    """groups: the engine's Programs; specs: (group index, name, flags, cache, args). Builds the
    specs in `workers` processes; returns how many were built (0 if a worker failed: the engine
    then builds what is missing itself)."""
    shapes = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
    jobs = [[] for _ in range(workers)]
    for i, (g, name, flags, cache, args) in enumerate(specs):
        jobs[i % workers].append((g, name, flags, shapes(cache), shapes(args)))
    recipes = [g.recipe for g in groups]
    # Fresh interpreters (`python -m`), not multiprocessing: a spawned child would re-run the
    # caller's script, and a forked one would share this process's GPU context.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",  # the engine holds most of the memory
               JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or "",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(jax.config.jax_persistent_cache_min_compile_time_secs),
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=str(jax.config.jax_persistent_cache_min_entry_size_bytes))
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, job in enumerate(jobs):
            path = os.path.join(tmp, f"job{i}.pkl")
            with open(path, "wb") as f:
                pickle.dump((recipes, job), f)
            with open(path + ".err", "wb") as err:  # a file, not a pipe: a chatty child cannot block on it
                procs.append((subprocess.Popen([sys.executable, "-m", "jaxspec.program_workers", path], env=env,
                                               stdout=subprocess.DEVNULL, stderr=err), path + ".err"))
        done = [(p.wait(), err) for p, err in procs]
        failed = [(rc, open(err, errors="replace").read()) for rc, err in done if rc != 0]
    if failed:
        rc, err = failed[0]
        warnings.warn(f"{len(failed)} of {workers} program workers failed (exit {rc}: {err.strip()[-500:]}); "
                      "this process builds what they left")
        return 0
    return len(specs)


def _build(recipes, job):
    from flax import nnx

    from jaxspec.program_store import enable_compilation_cache
    from jaxspec.programs import Programs
    enable_compilation_cache(os.environ.get("JAX_COMPILATION_CACHE_DIR") or "off")
    groups = []
    for graphs, abstract, drafter_of, attn_impl, store in recipes:
        if len(graphs) == 1:
            model, drafter = nnx.merge(graphs[0], abstract), None
        else:
            model = nnx.merge(graphs[0], abstract[0])
            cls, tree, policy_shapes = drafter_of
            drafter = cls(nnx.merge(graphs[1], abstract[1]), tree).with_policy_shapes(policy_shapes)
        groups.append(Programs(model, attn_impl=attn_impl, drafter=drafter, store=store))
    for i, g in enumerate(groups):
        g.build([spec[1:] for spec in job if spec[0] == i])


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        _build(*pickle.load(f))
