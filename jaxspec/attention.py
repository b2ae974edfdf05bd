"""Attention dispatch: the Pallas kernel on GPU where it applies, the jnp reference elsewhere."""
from __future__ import annotations

import jax

from jaxspec.pallas.attention_ref import paged_attention_ref


def kernel_supports(q, k_pages, tree_mask) -> bool:
    ps, d = k_pages.shape[2], k_pages.shape[-1]
    pow2 = lambda n: n & (n - 1) == 0
    # Triton's dot wants every dimension >= 16; trees are bit-packed into two 32-bit words.
    return ps >= 16 and pow2(ps) and d in (64, 128) and (tree_mask is None or q.shape[1] <= 64)


def paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask=None, impl="auto"):
    """q [B, T, Hq, D]; k_pages/v_pages [L, N, ps, Hkv, D] (all layers); layer: traced index.

    impl: 'auto' (the kernel on GPU where it applies), 'pallas' (kernel; interpreted off-GPU), 'ref'.
    """
    on_gpu = jax.default_backend() == "gpu"
    # on the H100 the kernel (split-K, 64-key tiles) is at least level with XLA's gather + dense
    # attention at batch 1 and 2-3x faster at batch 64 and for extend (bench/results/kernels-*.json)
    use = impl == "pallas" or (impl == "auto" and on_gpu)
    if use and kernel_supports(q, k_pages, tree_mask):
        from jaxspec.pallas.paged_attention import paged_attention as kernel
        return kernel(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask, interpret=not on_gpu)
    return paged_attention_ref(q, k_pages[layer], v_pages[layer], page_table, kv_lens, q_lens, tree_mask)
