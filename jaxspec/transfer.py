"""Host <-> device copies of a step's small arrays, one copy each way.

A step's inputs (tokens, page table, kv lengths, sampling parameters: a dozen small arrays) and
its outputs (tokens, counts, logprobs, the next tree) cost a copy and a Python round trip per
array when moved one by one: at batch 1 that is most of a small model's host time per step. Here
all 4-byte leaves travel as one uint32 buffer, split (inputs) or joined (outputs) by a small jitted
program on the device side.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _layout(leaves):
    return tuple((str(x.dtype), tuple(x.shape)) for x in leaves)


def to_device(tree):
    """device_put(tree), with all numpy leaves in one copy; jax.Array and None leaves pass through."""
    leaves, treedef = jax.tree.flatten(tree)
    host = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray)]
    if host:  # one leaf too: every argument of a program is then a jit output (one cache entry)
        arrays = [np.ascontiguousarray(leaves[i]) for i in host]
        for a in arrays:
            if a.dtype.itemsize != 4:
                raise TypeError(f"to_device packs 4-byte dtypes only, got {a.dtype}")
        buf = jax.device_put(np.concatenate([a.view(np.uint32).ravel() for a in arrays]))
        for i, x in zip(host, _split(buf, _layout(arrays))):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def to_host(tree):
    """device_get(tree) in one copy: the leaves are joined on the device first."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) < 2:
        return jax.device_get(tree)
    layout = _layout(leaves)
    buf = np.asarray(jax.device_get(_join(leaves)))
    out, start = [], 0
    for dtype, shape in layout:
        n = int(np.prod(shape))
        out.append(buf[start:start + n].view(dtype).reshape(shape))
        start += n
    return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=1)
def _split(buf, layout):
    out, start = [], 0
    for dtype, shape in layout:
        n = int(np.prod(shape))
        out.append(jax.lax.bitcast_convert_type(buf[start:start + n], jnp.dtype(dtype)).reshape(shape))
        start += n
    return out


@jax.jit
def _join(leaves):
    for x in leaves:
        if x.dtype.itemsize != 4:
            raise TypeError(f"to_host joins 4-byte dtypes only, got {x.dtype}")
    return jnp.concatenate([jax.lax.bitcast_convert_type(x, jnp.uint32).ravel() for x in leaves])
