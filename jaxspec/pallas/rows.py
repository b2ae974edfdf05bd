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
from jax.experimental.pallas import triton as plgpu

def rms_norm(x, w, eps):
    """The decoders' RMS norm (models.llama uses this one): the reference the kernels' fused norm
    is tested against, kept here so that the kernels' references need no model import. w None:
    no weight (one folded into the next matrix's rows)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf if w is None else xf * w.astype(jnp.float32)).astype(x.dtype)


def row_rms_scale(x_ref, row, eps):
    """1 / rms of row `row` of x_ref [M, H], float32, read in power-of-two chunks (Triton loads no
    other size; SmolLM2's 576 as 9 x 64): a kernel taking a norm whose weight is folded into its matrix."""
    hidden = x_ref.shape[1]
    chunk = min(hidden & -hidden, 4096)
    squares = sum(jnp.sum(jnp.square(x_ref[row, pl.ds(c * chunk, chunk)].astype(jnp.float32)))
                  for c in range(hidden // chunk))
    return jax.lax.rsqrt(squares / hidden + eps)


def padded_rows(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


def k_chunk(k: int, most: int = 256) -> int:
    """The K-loop step: a power of two, at least 16, at most `most` (or k rounded up to one). A
    ragged last chunk is read masked: SmolLM2's K = 576 takes 3 steps of 256, not 9 of 64."""
    return max(16, min(most, 1 << (k - 1).bit_length()))


def split_chunks(k: int, splits: int, bk: int | None) -> tuple[int, int]:
    """(K step, K chunks a split walks) for a kernel that splits K over `splits` programs: the
    chunks of the last split may run past K (project reads zeros there)."""
    bk = bk or k_chunk(-(-k // splits))
    return bk, -(-k // (bk * splits))


def dot(a, b):
    """[M, K] x [K, N] -> float32; float32 operands as IEEE dots (Triton would take TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=precision)


def project(x_ref, w_ref, cols, bn: int, bk: int, norm_ref=None, eps: float = 0.0, chunks=None):
    """x @ W[:, c : c + bn] for each c in cols -> float32 [Mp, bn] each; with norm_ref, rms_norm(x)
    @ W (the row's 1/rms scales the product: (x * s * g) @ W = s * ((x * g) @ W)). chunks: (first,
    count), only K chunks first .. first + count (a split of K; first may be traced), the products
    left unscaled by 1/rms (the caller scales the splits' sum).

    One loop over K with the norm's sum of squares in it. SmolLM2's QKV projection, one row, on the
    H200: 9.4 us this way (decode-smol-NVIDIA-H200.json, 47960d2), 9.7 with the sum of squares a
    loop of its own (decode-NVIDIA-H200.json, 154957e), 18 with the K loop unrolled in Python
    (register spills; that file's version at 921c261), against 2.4 for XLA's reduction."""
    k = x_ref.shape[1]
    rows = x_ref.shape[0]
    ragged = k % bk != 0 or chunks is not None  # (a split's chunks may run past K)

    def read(ref, idx, ok):  # the ragged last chunk reads zeros past K
        return plgpu.load(ref.at[idx], mask=ok, other=0) if ragged else ref[idx]

    def body(i, carry):
        accs, ss = carry
        k0 = pl.multiple_of(i * bk, bk)
        ok = k0 + jnp.arange(bk) < k
        xc = read(x_ref, (slice(None), pl.ds(k0, bk)), ok[None, :])
        if norm_ref is not None:
            xf = xc.astype(jnp.float32)
            ss = ss + jnp.sum(xf * xf, axis=1, keepdims=True)
            g = read(norm_ref, (pl.ds(k0, bk),), ok).astype(jnp.float32)
            xc = (xf * g[None, :]).astype(x_ref.dtype)
        return tuple(acc + dot(xc, read(w_ref, (pl.ds(k0, bk), pl.ds(c, bn)), ok[:, None]))
                     for acc, c in zip(accs, cols)), ss

    init = (tuple(jnp.zeros((rows, bn), jnp.float32) for _ in cols), jnp.zeros((rows, 1), jnp.float32))
    if chunks is not None:
        first, count = chunks
        return jax.lax.fori_loop(0, count, lambda i, c: body(first + i, c), init)[0]
    accs, ss = jax.lax.fori_loop(0, -(-k // bk), body, init)
    if norm_ref is not None:
        inv = jax.lax.rsqrt(ss / k + eps)
        accs = tuple(acc * inv for acc in accs)
    return accs


def full(x):
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def triton_params(num_warps=4, num_stages=3):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
