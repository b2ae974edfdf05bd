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
    """Where the H100 measurements put the kernel ahead: batch >= 8. At batch 1 the split-K kernel
    is level with XLA at 8B heads (bench/results/kernels-*.json) but SmolLM2's launch-bound steps
    got slower with it (plain 308 vs 404 tok/s, spec-v3-mtbench vs spec-newhead): its extra
    combine kernels per layer cost more than the attention saves there."""
    return q.shape[0] >= 8


def on_hopper() -> bool:
    """An sm_90 GPU (H100, H200): the wgmma and TMA that verify_hopper.py is written for."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask=None, impl="auto"):
    """q [B, T, Hq, D]; k_pages/v_pages [L, N, ps, Hkv, D] (all layers); layer: traced index.

    impl: 'auto' (the kernels on GPU where they win), 'pallas' (the Triton kernel; interpreted
    off-GPU), 'ref', 'mosaic' (as 'pallas', but trees and chains of 2 to 64 tokens go to the Mosaic
    GPU verify kernel, verify_hopper.py). 'auto' on Hopper is 'mosaic': it beat the Triton kernel
    at 16, 32 and 64 tokens in every run of kernels-focus-v31..v39 (64 tokens: 315-343 us against
    498-537), and the engine's outputs with it equal the Triton run's (mosaic_engine_check-*, 8/8
    requests at 6dda939 and, with persistent CTAs, at b3051e4)."""
    on_gpu = jax.default_backend() == "gpu"
    mosaic = impl == "mosaic" or (impl == "auto" and on_gpu and kernel_wins(q) and on_hopper())
    if mosaic and q.shape[1] > 1:
        from jaxspec.pallas import verify_hopper
        if verify_hopper.supports(q, k_pages, tree_mask, pages_per_seq=page_table.shape[1]):
            # persistent CTAs, one an SM: faster than a CTA an item in each of 15 comparisons
            # (kernels-focus-v37..v39: 16-64 tokens, contexts 1k-4k)
            n_sm = getattr(jax.devices()[0], "core_count", 0) if on_gpu else 0
            return verify_hopper.verify_tree_hopper(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens,
                                                    tree_mask, persistent=n_sm, interpret=not on_gpu)
    use = impl in ("pallas", "mosaic") or (impl == "auto" and on_gpu and kernel_wins(q))
    if use and kernel_supports(q, k_pages, tree_mask):
        from jaxspec.pallas.paged_attention import paged_attention as kernel
        return kernel(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask, interpret=not on_gpu)
    return paged_attention_ref(q, k_pages[layer], v_pages[layer], page_table, kv_lens, q_lens, tree_mask)
