"""residual + x @ W for a few rows, in one kernel (a decoder layer's output projections: attention
out and MLP down). XLA ran the GEMV as a reduction and the add as another kernel.

Grid: one program per block of bn output columns, walking K in chunks. `matmul_residual_ref` is
the reference. With splits > 1 the grid also splits K (as gated_up's: more programs, shorter K
chains; SmolLM2's down projection has 36 column blocks over K = 1536) and XLA sums the splits
and adds the residual after it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.pallas.rows import full, k_chunk, project, split_chunks, triton_params


def _matmul_residual_kernel(x_ref, w_ref, r_ref, o_ref, *, bn, bk):
    j = pl.program_id(0) * bn
    [acc] = project(x_ref, w_ref, (j,), bn, bk)
    # x @ W rounds to the activations' dtype before the add, as the unfused ops do
    o_ref[...] = r_ref[...] + acc.astype(o_ref.dtype)


def _matmul_split_kernel(x_ref, w_ref, o_ref, *, bn, bk, chunks):
    [acc] = project(x_ref, w_ref, (pl.program_id(0) * bn,), bn, bk, chunks=(pl.program_id(1) * chunks, chunks))
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("bn", "bk", "splits", "interpret", "num_warps", "num_stages"))
def matmul_residual(x, w, residual, *, bn=16, bk=None, splits=1, interpret=False, num_warps=4, num_stages=3):
    """x [Mp, K], w [K, N], residual [Mp, N] -> residual + x @ w."""
    m, k = x.shape
    n = w.shape[1]
    if splits > 1:
        bk, chunks = split_chunks(k, splits, bk)
        part = pl.pallas_call(
            functools.partial(_matmul_split_kernel, bn=bn, bk=bk, chunks=chunks),
            grid=(n // bn, splits),
            in_specs=[full(x), full(w)],
            out_specs=pl.BlockSpec((None, m, bn), lambda p, s: (s, 0, p)),
            out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
            interpret=interpret,
            compiler_params=None if interpret else triton_params(num_warps, num_stages),
        )(x, w)
        return residual + part.sum(0).astype(residual.dtype)  # rounded before the add, as below
    bk = bk or k_chunk(k)
    kernel = functools.partial(_matmul_residual_kernel, bn=bn, bk=bk)
    return pl.pallas_call(
        kernel,
        grid=(n // bn,),
        in_specs=[full(x), full(w), pl.BlockSpec((m, bn), lambda p: (0, p))],
        out_specs=pl.BlockSpec((m, bn), lambda p: (0, p)),
        out_shape=jax.ShapeDtypeStruct((m, n), residual.dtype),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
    )(x, w, residual)


def matmul_residual_ref(x, w, residual):
    return residual + x @ w
