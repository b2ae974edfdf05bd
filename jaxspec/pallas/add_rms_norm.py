"""A layer's residual add and the next RMS norm in one kernel: (x + delta, rms_norm(x + delta) * w).

Between the 8B's GEMMs at batch 1, XLA ran the residual add, the float32 convert, the sum of
squares and the scaling as separate kernels of 1.4-1.6 us each (a few thousand values, so each is
its launch and one trip to memory), twice a layer: about 320 us of a 4.77 ms step on the H200
(decode-8b-nocb-NVIDIA-H200.json). Here one program owns a row and reads it once.

The sum is rounded to x's dtype before the norm reads it, as the unfused layer does, so the kernel
and `add_rms_norm_ref` (the models' jnp path) differ only in the order of the sum of squares.
Tests run the kernel with interpret=True.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.pallas.rows import rms_norm, triton_params


def _kernel(x_ref, d_ref, w_ref, s_ref, y_ref, *, eps):
    s = (x_ref[...].astype(jnp.float32) + d_ref[...].astype(jnp.float32)).astype(s_ref.dtype)
    s_ref[...] = s
    sf = s.astype(jnp.float32)
    sf = sf * jax.lax.rsqrt(jnp.mean(sf * sf) + eps)
    y_ref[...] = (sf * w_ref[...].astype(jnp.float32)).astype(y_ref.dtype)


def add_rms_norm(x, delta, w, eps: float, *, interpret: bool = False):
    """x, delta [..., H] (H a power of two), w [H] -> (x + delta, rms_norm(x + delta, w)), both x's dtype."""
    h = x.shape[-1]
    assert h & (h - 1) == 0, f"add_rms_norm takes a power-of-two width, got {h}"
    x2, d2 = x.reshape(-1, h), delta.reshape(-1, h).astype(x.dtype)
    row = pl.BlockSpec((None, h), lambda i: (i, 0))
    out = jax.ShapeDtypeStruct(x2.shape, x.dtype)
    s, y = pl.pallas_call(functools.partial(_kernel, eps=eps), grid=(x2.shape[0],),
                          in_specs=[row, row, pl.BlockSpec((h,), lambda i: (0,))], out_specs=[row, row],
                          out_shape=[out, out], compiler_params=triton_params(num_warps=4, num_stages=1),
                          interpret=interpret, name="add_rms_norm")(x2, d2, w)
    return s.reshape(x.shape), y.reshape(x.shape)


def add_rms_norm_ref(x, delta, w, eps: float):
    s = x + delta.astype(x.dtype)
    return s, rms_norm(s, w, eps)
