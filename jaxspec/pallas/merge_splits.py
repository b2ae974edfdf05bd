"""Merges the split-K partial results of the paged attention kernel and writes them in token
layout, [tokens, Hq * D] (the next projection's input), in one kernel: XLA ran the merge as four
kernels (maximum, exponentials, weighted sum, and the relayout from the kernel's (kv head,
token x group member) rows).

Grid (request, kv head, block of 16 rows). Each program folds the splits into a [16, D]
accumulator (whole [S, rows, D] tiles would not fit in registers). `merge_splits_ref` is the
reference (combine_splits, the same merge in jnp, plus the relayout).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.rows import full, triton_params

ROWS = 16


def _merge_kernel(acc_ref, m_ref, l_ref, o_ref, *, tokens, group, num_q_heads):
    b, kh, rb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    splits, d = acc_ref.shape[2], acc_ref.shape[4]
    r = rb * ROWS + jnp.arange(ROWS)
    m = m_ref[b, kh, :, pl.ds(rb * ROWS, ROWS)]  # [S, ROWS], base-2 maxima
    m_all = jnp.max(m, axis=0)

    total, norm = jnp.zeros((ROWS, d), jnp.float32), jnp.zeros((ROWS,), jnp.float32)
    for s in range(splits):  # unrolled: every split's loads in flight at once (a loop took ~7 us)
        w = jnp.exp2(m_ref[b, kh, s, pl.ds(rb * ROWS, ROWS)] - m_all)  # an empty split: l = 0, acc = 0
        total = total + acc_ref[b, kh, s, pl.ds(rb * ROWS, ROWS), :] * w[:, None]
        norm = norm + l_ref[b, kh, s, pl.ds(rb * ROWS, ROWS)] * w
    out = (total / jnp.maximum(norm, 1e-30)[:, None]).astype(o_ref.dtype)
    t, gi = r // group, r % group
    row = (b * tokens + t) * num_q_heads + kh * group + gi  # o_ref seen as [tokens * Hq, D]
    plgpu.store(o_ref.at[row[:, None], jnp.arange(d)[None, :]], out, mask=(t < tokens)[:, None])


@functools.partial(jax.jit, static_argnames=("tokens", "group", "out_rows", "dtype", "interpret"))
def merge_splits(acc, m, l, *, tokens, group, out_rows, dtype, interpret=False):
    """acc [B, Hkv, S, R, D], m / l [B, Hkv, S, R] (R: token x group member rows, padded) ->
    [out_rows, Hq * D]: row b * tokens + t holds token t of request b (rows past B * tokens are
    left unwritten)."""
    b, hkv, _, rows, d = acc.shape
    hq = hkv * group
    kernel = functools.partial(_merge_kernel, tokens=tokens, group=group, num_q_heads=hq)
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv, rows // ROWS),
        in_specs=[full(acc), full(m), full(l)],
        out_specs=pl.BlockSpec((out_rows * hq, d), lambda *_: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((out_rows * hq, d), dtype),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(4, 1),
    )(acc, m, l)
    return out.reshape(out_rows, hq * d)


def combine_splits(acc, m, l):
    """acc [..., S, R, D], m/l [..., S, R] partials of S key ranges -> [..., R, D] softmax output."""
    m_all = m.max(axis=-2, keepdims=True)
    # the kernel's maxima are in base 2; an empty split has m = NEG_INF, l = 0: weight 0 unless all are empty
    w = jnp.exp2(m - m_all)
    l_all = (l * w).sum(axis=-2)
    return (acc * w[..., None]).sum(axis=-3) / jnp.maximum(l_all, 1e-30)[..., None]


def merge_splits_ref(acc, m, l, *, tokens, group, out_rows, dtype):
    b, hkv, _, _, d = acc.shape
    out = combine_splits(acc, m, l)[:, :, :tokens * group]  # [B, Hkv, T * g, D]
    out = out.reshape(b, hkv, tokens, group, d).transpose(0, 2, 1, 3, 4).reshape(b * tokens, hkv * group * d)
    return jnp.zeros((out_rows, out.shape[1]), dtype).at[:b * tokens].set(out.astype(dtype))
