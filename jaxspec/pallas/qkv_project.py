"""A decoder layer's attention input for a few rows, in one kernel: RMS norm, the fused [q | k | v]
GEMM, bias (Qwen2), per-head norm (Qwen3) and rope; K and V are stored straight into the paged
cache at the tokens' slots and Q is returned. XLA ran this as ~9 kernels a layer (norm, GEMV,
bias, rope, splits, two scatters); at SmolLM2's size each costs more launch than work.

Grid: one program per (head, column block c): it computes columns c .. c + bn and their rope
partners c + D/2 .. c + D/2 + bn (rope rotates column i with i + D/2, HF's rotate-half layout),
so it rotates without leaving the kernel. Heads [0, Hq) are Q, then K, then V (no rope).

`qkv_project_ref` beside it is the reference; tests run the kernel with interpret=True.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.rows import full, k_chunk, project, rms_norm, triton_params


def _qkv_kernel(layer_ref, slots_ref, x_ref, norm_ref, w_ref, bias_ref, qn_ref, kn_ref, cos_ref, sin_ref, _k_in,
                _v_in, q_ref, k_ref, v_ref, *, eps, num_q, num_kv, head_dim, bn, bk, has_bias, qk_norm):
    d, half = head_dim, head_dim // 2
    p = pl.program_id(0)
    head, c = p // (half // bn), (p % (half // bn)) * bn
    col_a = head * d + c
    col_b = col_a + half
    acc_a, acc_b = project(x_ref, w_ref, (col_a, col_b), bn, bk, norm_ref, eps)
    dtype = x_ref.dtype
    a, b = acc_a.astype(dtype), acc_b.astype(dtype)
    if has_bias:
        a = a + bias_ref[pl.ds(col_a, bn)][None, :]
        b = b + bias_ref[pl.ds(col_b, bn)][None, :]
    af, bf = a.astype(jnp.float32), b.astype(jnp.float32)
    if qk_norm:  # bn == D/2: the program holds the whole head
        s = jax.lax.rsqrt((jnp.sum(af * af, axis=1, keepdims=True) + jnp.sum(bf * bf, axis=1, keepdims=True)) / d
                          + eps)
        is_q = head < num_q
        wa = jnp.where(is_q, qn_ref[pl.ds(0, bn)], kn_ref[pl.ds(0, bn)]).astype(jnp.float32)
        wb = jnp.where(is_q, qn_ref[pl.ds(half, bn)], kn_ref[pl.ds(half, bn)]).astype(jnp.float32)
        na, nb = (af * s * wa[None, :]).astype(dtype), (bf * s * wb[None, :]).astype(dtype)
        roped = head < num_q + num_kv
        af = jnp.where(roped, na.astype(jnp.float32), af)
        bf = jnp.where(roped, nb.astype(jnp.float32), bf)
    cos, sin = cos_ref[:, pl.ds(c, bn)], sin_ref[:, pl.ds(c, bn)]
    ra, rb = (af * cos - bf * sin).astype(dtype), (bf * cos + af * sin).astype(dtype)

    @pl.when(head < num_q)
    def _():
        q_ref[:, pl.ds(col_a, bn)] = ra
        q_ref[:, pl.ds(col_b, bn)] = rb

    layer = layer_ref[0]
    slots = slots_ref[...]
    ok = (slots >= 0)[:, None]
    rows = jnp.maximum(slots, 0)[:, None]
    cols_a = (c + jnp.arange(bn))[None, :]  # array indices on every axis: a scatter of [Mp, bn]

    @pl.when((head >= num_q) & (head < num_q + num_kv))
    def _():
        kh = head - num_q
        plgpu.store(k_ref.at[layer, rows, kh, cols_a], ra.astype(k_ref.dtype), mask=ok)
        plgpu.store(k_ref.at[layer, rows, kh, cols_a + half], rb.astype(k_ref.dtype), mask=ok)

    @pl.when(head >= num_q + num_kv)
    def _():
        vh = head - num_q - num_kv
        plgpu.store(v_ref.at[layer, rows, vh, cols_a], a.astype(v_ref.dtype), mask=ok)
        plgpu.store(v_ref.at[layer, rows, vh, cols_a + half], b.astype(v_ref.dtype), mask=ok)


def column_block(head_dim: int, qk_norm: bool, bn: int | None = None) -> int:
    half = head_dim // 2
    return half if qk_norm else min(half, bn or 16)


@functools.partial(jax.jit, static_argnames=("num_q", "num_kv", "eps", "bn", "bk", "interpret", "num_warps",
                                             "num_stages"), donate_argnums=(10, 11))
def qkv_project(x, norm_w, w, bias, q_norm, k_norm, cos, sin, layer, slots, k_pages, v_pages, *, num_q, num_kv,
                eps, bn=None, bk=None, interpret=False, num_warps=4, num_stages=3):
    """x [Mp, H] (rows padded, see rows.py); w [H, (Hq + 2 Hkv) D]; bias / q_norm / k_norm or None;
    cos, sin [Mp, D/2] float32 (rope table of each row); slots [Mp] each row's cache slot
    (page * page_size + offset; -1: not stored); k_pages, v_pages [L, N, ps, Hkv, D] (donated).
    Returns (q [Mp, Hq * D] roped, k_pages, v_pages with the rows' K/V at `layer`)."""
    m, h = x.shape
    d = k_pages.shape[-1]
    bn = column_block(d, q_norm is not None, bn)
    bk = bk or k_chunk(h)
    num_programs = (num_q + 2 * num_kv) * (d // 2 // bn)
    one = jnp.zeros((1,), x.dtype)
    shape = k_pages.shape
    k_rows = k_pages.reshape(shape[0], -1, *shape[3:])  # [L, N * ps, Hkv, D]: adjacent axes, no copy
    v_rows = v_pages.reshape(shape[0], -1, *shape[3:])
    args = (jnp.asarray(layer, jnp.int32).reshape(1), slots.astype(jnp.int32), x, norm_w, w,
            one if bias is None else bias, one if q_norm is None else q_norm, one if k_norm is None else k_norm,
            cos.astype(jnp.float32), sin.astype(jnp.float32), k_rows, v_rows)
    kernel = functools.partial(_qkv_kernel, eps=eps, num_q=num_q, num_kv=num_kv, head_dim=d, bn=bn, bk=bk,
                               has_bias=bias is not None, qk_norm=q_norm is not None)
    q, k_rows, v_rows = pl.pallas_call(
        kernel,
        grid=(num_programs,),
        in_specs=[full(a) for a in args],
        out_specs=[pl.BlockSpec((m, num_q * d), lambda p: (0, 0)), full(k_rows), full(v_rows)],
        out_shape=[jax.ShapeDtypeStruct((m, num_q * d), x.dtype), jax.ShapeDtypeStruct(k_rows.shape, k_rows.dtype),
                   jax.ShapeDtypeStruct(v_rows.shape, v_rows.dtype)],
        input_output_aliases={10: 1, 11: 2},
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
    )(*args)
    return q, k_rows.reshape(shape), v_rows.reshape(shape)


def qkv_project_ref(x, norm_w, w, bias, q_norm, k_norm, cos, sin, layer, slots, k_pages, v_pages, *, num_q,
                    num_kv, eps):
    """The same in plain jnp (models.llama's Block ops)."""
    m, _ = x.shape
    d = k_pages.shape[-1]
    qkv = rms_norm(x, norm_w, eps) @ w
    if bias is not None:
        qkv = qkv + bias
    q, k, v = jnp.split(qkv.reshape(m, num_q + 2 * num_kv, d), [num_q, num_q + num_kv], axis=1)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)

    def rope(t):
        t1, t2 = jnp.split(t.astype(jnp.float32), 2, axis=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return jnp.concatenate([t1 * c - t2 * s, t2 * c + t1 * s], axis=-1).astype(x.dtype)

    q, k = rope(q), rope(k)
    ps = k_pages.shape[2]
    page = jnp.where(slots >= 0, slots // ps, 2**30)
    off = jnp.maximum(slots, 0) % ps
    k_pages = k_pages.at[layer, page, off].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[layer, page, off].set(v.astype(v_pages.dtype), mode="drop")
    return q.reshape(m, -1), k_pages, v_pages
