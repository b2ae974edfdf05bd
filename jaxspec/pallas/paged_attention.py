"""Paged attention kernel: extend/prefill, decode and tree verify in one Pallas kernel.

Grid (request, kv head, query block). A program holds the query rows of one KV head's whole GQA
group, (token, group-member) flattened into rows, so each K/V page is read once per group. It
walks the request's pages in the page table with an online softmax. The new tokens' visibility
among themselves is either causal (computed) or a draft tree, passed bit-packed: bit j of
tree_bits[b, t, j // 32] says query t may read new token j, so a [T, T] mask never leaves the
tree-mask program as bools.

`paged_attention_ref` in attention_ref.py is the reference; tests run this with interpret=True.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.pallas.attention_ref import NEG_INF


def pack_tree_mask(tree_mask):
    """[B, T, T] bool -> [B, T, 2] int32 bit words (T <= 64)."""
    b, t, _ = tree_mask.shape
    assert t <= 64, "tree verify supports at most 64 query tokens"
    m = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, 64 - t))).reshape(b, t, 2, 32).astype(jnp.uint32)
    words = (m << jnp.arange(32, dtype=jnp.uint32)).sum(-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def _kernel(layer_ref, pt_ref, kv_lens_ref, q_lens_ref, bits_ref, q_ref, k_ref, v_ref, o_ref, *,
            group, page_size, block_rows, scale, causal, softcap):
    b, h, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    kv_len, q_len = kv_lens_ref[b], q_lens_ref[b]
    rows = qb * block_rows + jnp.arange(block_rows)
    t = rows // group  # query token of each row
    q = q_ref[...].astype(jnp.float32) * scale
    if not causal:
        w0 = bits_ref[b, :, 0]
        w1 = bits_ref[b, :, 1]
        num_t = w0.shape[0]
        tt = jnp.minimum(t, num_t - 1)
        # gather each row's words: one-hot over the (small) token axis keeps it to elementwise ops
        onehot = (tt[:, None] == jnp.arange(num_t)[None, :])
        rw0 = jnp.sum(jnp.where(onehot, w0[None, :], 0), axis=1)
        rw1 = jnp.sum(jnp.where(onehot, w1[None, :], 0), axis=1)
    num_pages = (kv_len + q_len + page_size - 1) // page_size

    def body(p, carry):
        m, l, acc = carry
        page = pt_ref[b, p]
        k = k_ref[layer, page, :, h, :].astype(jnp.float32)
        v = v_ref[layer, page, :, h, :].astype(jnp.float32)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        rel = p * page_size + jnp.arange(page_size)[None, :] - kv_len
        if causal:
            among = rel <= t[:, None]
        else:
            word = jnp.where(rel < 32, rw0[:, None], rw1[:, None])
            among = ((word >> jnp.clip(rel % 32, 0, 31)) & 1) == 1
        ok = (rel < 0) | ((rel < q_len) & among)
        s = jnp.where(ok, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp(m - m_new)
        pr = jnp.exp(s - m_new[:, None])
        l = l * corr + pr.sum(axis=1)
        acc = acc * corr[:, None] + jax.lax.dot_general(pr, v, (((1,), (0,)), ((), ())),
                                                        preferred_element_type=jnp.float32)
        return m_new, l, acc

    d = q.shape[1]
    init = (jnp.full((block_rows,), NEG_INF, jnp.float32), jnp.zeros((block_rows,), jnp.float32),
            jnp.zeros((block_rows, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_pages, body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "block_rows", "softcap", "num_warps", "num_stages"))
def paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask=None, *,
                    interpret=False, block_rows=None, softcap=None, num_warps=4, num_stages=2):
    """q [B, T, Hq, D]; k_pages/v_pages [L, N, ps, Hkv, D]; layer: scalar -> [B, T, Hq, D]."""
    b, t, hq, d = q.shape
    _, _, ps, hkv, _ = k_pages.shape
    g = hq // hkv
    rows = t * g
    if block_rows is None:
        block_rows = max(16, min(64, 1 << (rows - 1).bit_length()))
    padded = -(-rows // block_rows) * block_rows
    qr = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    causal = tree_mask is None
    bits = jnp.zeros((b, 1, 2), jnp.int32) if causal else pack_tree_mask(tree_mask)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(_kernel, group=g, page_size=ps, block_rows=block_rows, scale=d ** -0.5,
                               causal=causal, softcap=softcap)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    qspec = pl.BlockSpec((None, None, block_rows, d), lambda i, j, k: (i, j, k, 0))
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv, padded // block_rows),
        in_specs=[full(layer), full(page_table), full(kv_lens), full(q_lens), full(bits), qspec,
                  full(k_pages), full(v_pages)],
        out_specs=qspec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else _triton_params(num_warps, num_stages),
    )(layer, page_table, kv_lens, q_lens, bits, qr, k_pages, v_pages)
    out = out[:, :, :rows].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d)


def _triton_params(num_warps, num_stages):
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
