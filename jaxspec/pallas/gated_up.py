"""A decoder layer's MLP input for a few rows, in one kernel: silu(rms_norm(x) @ W_gate) *
(rms_norm(x) @ W_up), with W = [gate | up] the fused matrix. XLA ran the norm, the GEMV and the
gating as separate kernels.

Grid: one program per block of bn intermediate columns j: it reads gate columns j and up
columns F + j, so the gating never leaves the kernel. `gated_up_ref` is the reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.pallas.rows import full, k_chunk, project, rms_norm, triton_params


def _gated_up_kernel(x_ref, norm_ref, w_ref, o_ref, *, eps, bn, bk, inter):
    j = pl.program_id(0) * bn
    gate, up = project(x_ref, w_ref, (j, inter + j), bn, bk, norm_ref, eps)
    # rounded to the activations' dtype between steps, as the unfused ops are
    gate = gate.astype(o_ref.dtype).astype(jnp.float32)
    up = up.astype(o_ref.dtype).astype(jnp.float32)
    o_ref[...] = ((gate * jax.nn.sigmoid(gate)).astype(o_ref.dtype).astype(jnp.float32) * up).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "bn", "bk", "interpret", "num_warps", "num_stages"))
def gated_up(x, norm_w, w_gate_up, *, eps, bn=16, bk=None, interpret=False, num_warps=4, num_stages=3):
    """x [Mp, H]; w_gate_up [H, 2F] -> [Mp, F]."""
    m, h = x.shape
    inter = w_gate_up.shape[1] // 2
    bk = bk or k_chunk(h)
    kernel = functools.partial(_gated_up_kernel, eps=eps, bn=bn, bk=bk, inter=inter)
    return pl.pallas_call(
        kernel,
        grid=(inter // bn,),
        in_specs=[full(x), full(norm_w), full(w_gate_up)],
        out_specs=pl.BlockSpec((m, bn), lambda p: (0, p)),
        out_shape=jax.ShapeDtypeStruct((m, inter), x.dtype),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
    )(x, norm_w, w_gate_up)


def gated_up_ref(x, norm_w, w_gate_up, *, eps):
    gate, up = jnp.split(rms_norm(x, norm_w, eps) @ w_gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up
