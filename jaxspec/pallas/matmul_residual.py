"""residual + x @ W for a few rows, in one kernel (a decoder layer's output projections: attention
out and MLP down). XLA ran the GEMV as a reduction and the add as another kernel.

Grid: one program per block of bn output columns, walking K in chunks. `matmul_residual_ref` is
the reference.
"""
from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from jaxspec.pallas.rows import full, k_chunk, project, triton_params


def _matmul_residual_kernel(x_ref, w_ref, r_ref, o_ref, *, bn, bk):
    j = pl.program_id(0) * bn
    [acc] = project(x_ref, w_ref, (j,), bn, bk)
    # x @ W rounds to the activations' dtype before the add, as the unfused ops do
    o_ref[...] = r_ref[...] + acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bn", "bk", "interpret", "num_warps", "num_stages"))
def matmul_residual(x, w, residual, *, bn=16, bk=None, interpret=False, num_warps=4, num_stages=3):
    """x [Mp, K], w [K, N], residual [Mp, N] -> residual + x @ w."""
    m, k = x.shape
    n = w.shape[1]
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
