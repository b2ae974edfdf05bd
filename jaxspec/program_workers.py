"""A cold start's program set built by several processes at once.

Tracing and lowering a program is Python work that threads cannot share (the GIL): on the H100
the EAGLE-3 engine's 32 programs lowered for 74 s of a 124 s cold warm-up (startup-*.json). So
when the store (program_store.py) lacks many of an engine's programs, worker processes each
export and compile a share of them from the programs' recipe (graph definitions and weight
shapes, no weights) into the store and JAX's compilation cache; the engine then reads every
program back as on a warm start.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import types
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
    specs in `workers` processes; returns how many were built (0 if the workers failed: the
    engine then builds them itself)."""
    shapes = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
    jobs = [[] for _ in range(workers)]
    for i, (g, name, flags, cache, args) in enumerate(specs):
        jobs[i % workers].append((g, name, flags, shapes(cache), shapes(args)))
    recipes = [g.recipe for g in groups]
    ctx = multiprocessing.get_context("spawn")  # a forked child would share the parent's GPU context
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start,
                                                    initargs=(jax.config.jax_compilation_cache_dir,)) as pool:
            return sum(pool.map(_build, [recipes] * workers, jobs))
    except Exception as e:  # noqa: BLE001 - a worker that died (memory, a signal) costs time, not correctness
        warnings.warn(f"building programs in worker processes failed ({type(e).__name__}: {e}); "
                      "building them in this process")
        return 0


def _start(cache_dir):
    # the engine's process holds most of the GPU's memory: a worker takes only what it uses
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    from jaxspec.programs import enable_compilation_cache
    enable_compilation_cache(cache_dir)


def _build(recipes, job) -> int:
    from flax import nnx

    from jaxspec.programs import Programs
    groups = []
    for graphs, abstract, tree, attn_impl, store in recipes:
        if len(graphs) == 1:
            model, drafter = nnx.merge(graphs[0], abstract), None
        else:
            model = nnx.merge(graphs[0], abstract[0])
            drafter = types.SimpleNamespace(head=nnx.merge(graphs[1], abstract[1]), tree=tree)
        groups.append(Programs(model, attn_impl=attn_impl, drafter=drafter, store=store))
    for i, g in enumerate(groups):
        g.build([spec[1:] for spec in job if spec[0] == i])
    return len(job)
