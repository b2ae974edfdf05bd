"""Pieces shared by the skinny-row layer kernels (qkv_project, gated_up, matmul_residual): a few
rows of activations (decode, short verify) against a weight matrix read once.

Rows come padded to `padded_rows(m)` (a power of two, at least 16: Triton's dot wants every
dimension >= 16), so the kernels load whole tiles with no masks. Each program owns a block of
output columns and reads the K dimension in chunks of `k_chunk(K)`, accumulating in float32.
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


def project(x_ref, w_ref, cols, bn: int, bk: int, norm_ref=None, eps: float = 0.0):
    """x @ W[:, c : c + bn] for each c in cols -> float32 [Mp, bn] each; with norm_ref, rms_norm(x)
    @ W (the row's 1/rms scales the product: (x * s * g) @ W = s * ((x * g) @ W)).

    One loop over K with the norm's sum of squares in it. Measured on the H200 (SmolLM2 QKV, one
    row): 9.7 us with the sum of squares a loop of its own (decode-NVIDIA-H200.json, 154957e), 18
    us with the K loop unrolled in Python (register spills; decode-smol-NVIDIA-H200.json), against
    2.4 for XLA's reduction."""
    k = x_ref.shape[1]
    rows = x_ref.shape[0]

    def body(i, carry):
        accs, ss = carry
        k0 = pl.multiple_of(i * bk, bk)
        xc = x_ref[:, pl.ds(k0, bk)]
        if norm_ref is not None:
            xf = xc.astype(jnp.float32)
            ss = ss + jnp.sum(xf * xf, axis=1, keepdims=True)
            xc = (xf * norm_ref[pl.ds(k0, bk)].astype(jnp.float32)[None, :]).astype(x_ref.dtype)
        return tuple(acc + dot(xc, w_ref[pl.ds(k0, bk), pl.ds(c, bn)]) for acc, c in zip(accs, cols)), ss

    init = (tuple(jnp.zeros((rows, bn), jnp.float32) for _ in cols), jnp.zeros((rows, 1), jnp.float32))
    accs, ss = jax.lax.fori_loop(0, k // bk, body, init)
    if norm_ref is not None:
        inv = jax.lax.rsqrt(ss / k + eps)
        accs = tuple(acc * inv for acc in accs)
    return accs


def full(x):
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def triton_params(num_warps=4, num_stages=3):
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
