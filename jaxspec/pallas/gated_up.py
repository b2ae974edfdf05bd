"""A decoder layer's MLP input for a few rows, in one kernel: silu(rms_norm(x) @ W_gate) *
(rms_norm(x) @ W_up), with W = [gate | up] the fused matrix. XLA ran the norm, the GEMV and the
gating as separate kernels.

Grid: one program per block of bn intermediate columns j: it reads gate columns j and up
columns F + j, so the gating never leaves the kernel. `gated_up_ref` is the reference.

With splits > 1 the grid also splits K: each program walks 1/splits of it, so a one-row GEMV has
splits times the programs and a K chain as many times shorter (at SmolLM2's shape one kernel a
layer took 9.4 us on the H100, step_profile-NVIDIA-H100-80GB-HBM3.json; XLA's ops 3.2 us on the
H200, fused_probe-NVIDIA-H200.json), and XLA
sums the splits, scales by the rows' 1/rms and gates in one fusion after it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.pallas.rows import full, k_chunk, project, rms_norm, split_chunks, triton_params


def _gated_up_kernel(x_ref, norm_ref, w_ref, o_ref, *, eps, bn, bk, inter):
    j = pl.program_id(0) * bn
    gate, up = project(x_ref, w_ref, (j, inter + j), bn, bk, norm_ref, eps)
    o_ref[...] = _gating(gate, up, o_ref.dtype)


def _gating(gate, up, dtype):
    """silu(gate) * up from float32 products, rounded to the activations' dtype between steps as
    the unfused ops are (in the kernel, and after a K split's sum)."""
    gate = gate.astype(dtype).astype(jnp.float32)
    up = up.astype(dtype).astype(jnp.float32)
    return ((gate * jax.nn.sigmoid(gate)).astype(dtype).astype(jnp.float32) * up).astype(dtype)


def _gated_up_split_kernel(x_ref, norm_ref, w_ref, gate_ref, up_ref, *, bn, bk, inter, chunks):
    j = pl.program_id(0) * bn
    gate, up = project(x_ref, w_ref, (j, inter + j), bn, bk, norm_ref, chunks=(pl.program_id(1) * chunks, chunks))
    gate_ref[...] = gate
    up_ref[...] = up


@functools.partial(jax.jit, static_argnames=("eps", "bn", "bk", "splits", "interpret", "num_warps", "num_stages"))
def gated_up(x, norm_w, w_gate_up, *, eps, bn=16, bk=None, splits=1, interpret=False, num_warps=4, num_stages=3):
    """x [Mp, H]; w_gate_up [H, 2F] -> [Mp, F]."""
    m, h = x.shape
    inter = w_gate_up.shape[1] // 2
    if splits > 1:
        return _gated_up_split(x, norm_w, w_gate_up, eps, bn, bk, splits, interpret, num_warps, num_stages)
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


def _gated_up_split(x, norm_w, w_gate_up, eps, bn, bk, splits, interpret, num_warps, num_stages):
    m, h = x.shape
    inter = w_gate_up.shape[1] // 2
    bk, chunks = split_chunks(h, splits, bk)
    kernel = functools.partial(_gated_up_split_kernel, bn=bn, bk=bk, inter=inter, chunks=chunks)
    part = jax.ShapeDtypeStruct((splits, m, inter), jnp.float32)
    gate, up = pl.pallas_call(
        kernel,
        grid=(inter // bn, splits),
        in_specs=[full(x), full(norm_w), full(w_gate_up)],
        out_specs=[pl.BlockSpec((None, m, bn), lambda p, s: (s, 0, p))] * 2,
        out_shape=[part, part],
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
    )(x, norm_w, w_gate_up)
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return _gating(gate.sum(0) * inv, up.sum(0) * inv, x.dtype)


def gated_up_ref(x, norm_w, w_gate_up, *, eps):
    gate, up = jnp.split(rms_norm(x, norm_w, eps) @ w_gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up
