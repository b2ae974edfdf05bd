"""Attention dispatch: the Pallas kernels on GPU, a chunked jnp path elsewhere.

The page table has one fixed width (the longest sequence the engine admits), so its width is no
compile-time dimension. Every path therefore reads only the pages a request uses: the kernels
stop at each request's length, and the jnp path walks the table a chunk of pages at a time, up to
the batch's longest sequence (a loop whose trip count is computed on the device).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.pallas.attention_ref import NEG_INF, visible_mask

CHUNK_KEYS = 1024  # keys per chunk of the jnp path


def kernel_supports(q, k_pages, tree_mask) -> bool:
    ps, d = k_pages.shape[2], k_pages.shape[-1]
    pow2 = lambda n: n & (n - 1) == 0
    # Triton's dot wants every dimension >= 16; trees are bit-packed into two 32-bit words.
    return ps >= 16 and pow2(ps) and d in (64, 128) and (tree_mask is None or q.shape[1] <= 64)


def on_hopper() -> bool:
    """An sm_90 GPU (H100, H200): the wgmma and TMA that verify_hopper.py is written for."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask=None, impl="auto"):
    """q [B, T, Hq, D]; k_pages/v_pages [L, N, ps, Hkv, D] (all layers) -> [B, T, Hq, D].

    impl: 'auto' (the kernels on GPU), 'pallas' (the Triton kernel; interpreted off-GPU), 'ref'
    (the chunked jnp path), 'mosaic' (as 'pallas', but trees and chains of 2 to 64 tokens go to the
    Mosaic GPU verify kernel, verify_hopper.py). 'auto' on Hopper is 'mosaic': it beat the Triton
    kernel at 16, 32 and 64 tokens in every run of kernels-focus-v31..v39, and the engine's outputs
    with it equal the Triton run's (mosaic_engine_check-*)."""
    on_gpu = jax.default_backend() == "gpu"
    mosaic = impl == "mosaic" or (impl == "auto" and on_gpu and on_hopper())
    if mosaic and q.shape[1] > 1:
        from jaxspec.pallas import verify_hopper
        if verify_hopper.supports(q, k_pages, tree_mask, pages_per_seq=page_table.shape[1]):
            # persistent CTAs, one an SM: faster than a CTA an item in each of 15 comparisons
            n_sm = getattr(jax.devices()[0], "core_count", 0) if on_gpu else 0
            return verify_hopper.verify_tree_hopper(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens,
                                                    tree_mask, persistent=n_sm, interpret=not on_gpu)
    use = impl in ("pallas", "mosaic") or (impl == "auto" and on_gpu)
    if use and kernel_supports(q, k_pages, tree_mask):
        from jaxspec.pallas.paged_attention import paged_attention as kernel
        return kernel(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask, interpret=not on_gpu)
    return paged_attention_chunked(q, k_pages[layer], v_pages[layer], page_table, kv_lens, q_lens, tree_mask)


def paged_attention_chunked(q, k_pages, v_pages, page_table, kv_lens, q_lens, tree_mask=None):
    """paged_attention_ref's function, reading CHUNK_KEYS keys at a time with an online softmax and
    stopping after the batch's longest sequence. k_pages/v_pages [N, ps, Hkv, D]."""
    b, t, hq, d = q.shape
    hkv = k_pages.shape[2]
    visible = lambda first, n: visible_mask(kv_lens, q_lens, t, n, tree_mask, first_key=first)
    _, l, acc = online_softmax_over_pages(q.reshape(b, t, hkv, hq // hkv, d), k_pages, v_pages, page_table,
                                          jnp.max(kv_lens + q_lens), visible)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)


def online_softmax_over_pages(qg, k_pages, v_pages, page_table, num_keys, visible):
    """Unnormalised attention of qg [B, T, Hkv, G, D] over the keys at slots < num_keys (a traced
    scalar) of each request's pages, CHUNK_KEYS at a time; visible(first slot, n) -> [B, T, n] bool.
    Returns the running max m and sum l [B, Hkv, G, T] and the output acc [B, Hkv, G, T, D]."""
    b, t, hkv, g, d = qg.shape
    ps = k_pages.shape[1]
    cp = max(1, min(CHUNK_KEYS // ps, page_table.shape[1]))  # pages a chunk
    table = jnp.pad(page_table, ((0, 0), (0, -page_table.shape[1] % cp)))

    def chunk(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, i * cp, cp, axis=1)
        k = k_pages[pages].reshape(b, cp * ps, hkv, d)
        v = v_pages[pages].reshape(b, cp * ps, hkv, d)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
        ok = visible(i * cp * ps, cp * ps)[:, None, None]
        m_new = jnp.maximum(m, jnp.where(ok, s, NEG_INF).max(-1))
        p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        acc = acc * corr[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v,
                                                 preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(-1), acc

    init = (jnp.full((b, hkv, g, t), NEG_INF, jnp.float32), jnp.zeros((b, hkv, g, t), jnp.float32),
            jnp.zeros((b, hkv, g, t, d), jnp.float32))
    return jax.lax.fori_loop(0, (num_keys + cp * ps - 1) // (cp * ps), chunk, init)
