"""Pieces shared by the skinny-row layer kernels (qkv_project, gated_up, matmul_residual): a few
rows of activations (decode, short verify) against a weight matrix read once.

Rows come padded to `padded_rows(m)` (a power of two, at least 16: Triton's dot wants every
dimension >= 16), so the kernels load whole tiles with no masks. Each program owns a block of
output columns and walks the K dimension in chunks of `k_chunk(K)`, accumulating in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MAX_ROWS = 64  # above this the GEMMs are XLA's (cuBLAS): the kernels read W once per row block


def padded_rows(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


def k_chunk(k: int, most: int = 256) -> int | None:
    """The largest power of two <= most dividing k (K-loop step), None if below 16."""
    bk = most
    while bk >= 16:
        if k % bk == 0:
            return bk
        bk //= 2
    return None


def dot(a, b):
    """[M, K] x [K, N] -> float32; float32 operands as IEEE dots (Triton would take TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=precision)


def rms_scale(x_ref, k: int, bk: int, eps: float):
    """[Mp, 1] float32 1/rms of the rows of x_ref [Mp, K], read bk columns at a time."""
    def body(i, ss):
        xc = x_ref[:, pl.ds(pl.multiple_of(i * bk, bk), bk)].astype(jnp.float32)
        return ss + jnp.sum(xc * xc, axis=1, keepdims=True)
    ss = jax.lax.fori_loop(0, k // bk, body, jnp.zeros((x_ref.shape[0], 1), jnp.float32))
    return jax.lax.rsqrt(ss / k + eps)


def normed_chunk(x_ref, norm_ref, inv, k0, bk):
    """Columns k0 .. k0 + bk of rms_norm(x) in x's dtype, rounded as models.llama.rms_norm rounds."""
    xc = x_ref[:, pl.ds(k0, bk)].astype(jnp.float32) * inv
    return (xc * norm_ref[pl.ds(k0, bk)].astype(jnp.float32)[None, :]).astype(x_ref.dtype)


def full(x):
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def triton_params(num_warps=4, num_stages=3):
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
