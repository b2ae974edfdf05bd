"""Attention dispatch: the Pallas kernel on GPU where it applies, the jnp reference elsewhere."""
from __future__ import annotations

import jax

from jaxspec.pallas.attention_ref import paged_attention_ref


def _use_kernel(impl: str) -> bool:
    if impl == "ref":
        return False
    if impl == "pallas":
        return True
    return jax.default_backend() == "gpu"


def paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask=None, impl="auto"):
    """q [B, T, Hq, D]; k_pages/v_pages [L, N, ps, Hkv, D] (all layers); layer: traced index."""
    if _use_kernel(impl):
        from jaxspec.pallas.paged_attention import paged_attention as kernel
        return kernel(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask,
                      interpret=jax.default_backend() != "gpu")
    return paged_attention_ref(q, k_pages[layer], v_pages[layer], page_table, kv_lens, q_lens, tree_mask)
