"""A decoder layer's MLP gating with the MLP norm in it: silu(s * gate) * (s * up), where
[gate | up] = x @ [W_gate | W_up] with the norm's weight folded into those rows (models.llama) and
s = 1 / rms(x) of each row, taken here. XLA runs the norm as a kernel of its own before the GEMM and
the gating as another after it; with the scale taken here the norm's kernel goes, the way the decode
attention kernel takes the attention norm's (paged_attention.py's `projection`).

Grid (row, block of bn intermediate columns): each program reads its row of x whole for the sum of
squares (a few KB, from L2 after the first), then its gate and up columns. `swiglu_ref` is the reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.pallas.rows import full, row_rms_scale, triton_params


def _kernel(x_ref, gate_up_ref, o_ref, *, eps, bn, inter):
    row, j = pl.program_id(0), pl.program_id(1) * bn
    scale = row_rms_scale(x_ref, row, eps)
    gate = gate_up_ref[row, pl.ds(j, bn)].astype(jnp.float32) * scale
    up = gate_up_ref[row, pl.ds(inter + j, bn)].astype(jnp.float32) * scale
    o_ref[row, pl.ds(j, bn)] = (gate * jax.nn.sigmoid(gate) * up).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def swiglu(x, gate_up, *, eps, interpret=False, num_warps=4):
    """x [M, H] (the MLP's input), gate_up [M, 2F] (x through the norm-folded [W_gate | W_up]) -> [M, F]."""
    m, inter = x.shape[0], gate_up.shape[1] // 2
    bn = min(1024, inter & -inter)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, bn=bn, inter=inter),
        grid=(m, inter // bn),
        in_specs=[full(x), full(gate_up)],
        out_specs=pl.BlockSpec((m, inter), lambda *_: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, inter), gate_up.dtype),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, 1),
    )(x, gate_up)


def swiglu_ref(x, gate_up, *, eps):
    xf = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    gate, up = jnp.split(gate_up.astype(jnp.float32) * scale, 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(gate_up.dtype)
