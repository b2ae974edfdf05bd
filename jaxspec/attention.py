"""Attention dispatch: the Pallas kernel on GPU where it applies, the jnp reference elsewhere."""
from __future__ import annotations

import jax

from jaxspec.pallas.attention_ref import paged_attention_ref


def kernel_supports(q, k_pages, tree_mask) -> bool:
    ps, d = k_pages.shape[2], k_pages.shape[-1]
    pow2 = lambda n: n & (n - 1) == 0
    # Triton's dot wants every dimension >= 16; trees are bit-packed into two 32-bit words.
    return ps >= 16 and pow2(ps) and d in (64, 128) and (tree_mask is None or q.shape[1] <= 64)


def kernel_wins(q) -> bool:
    """Where the H100 measurements (bench/results/kernels-*.json) put the kernel ahead of XLA:
    decode and tree verify at batch >= 8. Without split-K it loses at batch 1, and XLA's dense
    extend beats it for long prefill chunks."""
    return q.shape[0] >= 8 and q.shape[1] <= 64


def paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask=None, impl="auto"):
    """q [B, T, Hq, D]; k_pages/v_pages [L, N, ps, Hkv, D] (all layers); layer: traced index.

    impl: 'auto' (kernel on GPU where it wins), 'pallas' (kernel; interpreted off-GPU), 'ref'.
    """
    on_gpu = jax.default_backend() == "gpu"
    use = impl == "pallas" or (impl == "auto" and on_gpu and kernel_wins(q))
    if use and kernel_supports(q, k_pages, tree_mask):
        from jaxspec.pallas.paged_attention import paged_attention as kernel
        return kernel(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask, interpret=not on_gpu)
    return paged_attention_ref(q, k_pages[layer], v_pages[layer], page_table, kv_lens, q_lens, tree_mask)
