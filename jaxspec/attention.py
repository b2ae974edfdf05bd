"""Attention dispatch: the Pallas kernels on GPU, a chunked jnp path elsewhere.

The page table has one fixed width (the longest sequence the engine admits), so its width is no
compile-time dimension. Every path therefore reads only the pages a request uses: the kernels
stop at each request's length, and the jnp path walks the table a chunk of pages at a time, up to
the batch's longest sequence (a loop whose trip count is computed on the device, which on the
GPU would sync with the host each iteration: there every batch takes the kernels).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.pallas.attention_ref import NEG_INF, prefix_attention_ref, visible_mask
from jaxspec.pallas.paged_attention import token_layout

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


def _kernels_for(impl) -> bool:
    """Whether `impl` runs the Pallas kernels (interpreted off the GPU) where their shapes allow."""
    return impl in ("pallas", "mosaic", "fused") or (impl == "auto" and jax.default_backend() == "gpu")


def defers_kv_write(num_tokens: int, k_pages, tree_mask, impl="auto") -> bool:
    """Whether a step of num_tokens a request may attend with its new K/V beside the pages instead of in
    them (new_kv below): a decode step (T = 1, causal) on the Triton kernel, on one device. The
    model then writes every layer's K/V in one scatter after its last layer: two a layer before
    cost the 8B batch-1 step 0.146 ms of 4.43 on the H200 (layer_ablation-kvwrite-)."""
    return (num_tokens == 1 and tree_mask is None and _kernels_for(impl) and kernel_supports(None, k_pages, None)
            and jax.sharding.get_abstract_mesh().size <= 1)


def paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask=None, impl="auto",
                    token_rows=None, tokens=None, counts=None, new_kv=None, projection=None, eps=1e-5):
    """Under a tensor-parallel mesh (sharding.py) with heads that divide over it, each shard attends
    with its own query and KV heads (shard_map): the kernels never see the mesh. See
    local_paged_attention for the arguments; new_kv and projection only where defers_kv_write."""
    from jaxspec import sharding
    mesh = jax.sharding.get_abstract_mesh()
    tp = sharding.tp_size(mesh)
    if tp > 1 and tokens is not None:
        q, tokens = _by_request(q, kv_lens.shape[0], tokens, k_pages.shape[-1]), None
    if tp > 1 and q.shape[2] % tp == 0 and k_pages.shape[3] % tp == 0:
        heads, pages, whole = P(None, None, sharding.AXIS, None), P(None, None, None, sharding.AXIS, None), P()
        local = functools.partial(local_paged_attention, impl=impl)
        out = jax.shard_map(local, mesh=mesh, in_specs=(heads, pages, pages, whole, whole, whole, whole, whole),
                            out_specs=heads, check_vma=False)(q, k_pages, v_pages, layer, page_table, kv_lens,
                                                              q_lens, tree_mask)
        return _finish(out, token_rows, counts)
    return local_paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask, impl,
                                 token_rows, tokens, counts, new_kv, projection, eps)


def _by_request(q, b, t, d):
    """The fused layers' token layout [rows, Hq * D] (rows past B * T: padding) -> [B, T, Hq, D]."""
    return q[:b * t].reshape(b, t, -1, d)


def _finish(out, token_rows, counts):
    """out [B, T, Hq, D] in the layout asked for, with the counts passed in (no kernel used them)."""
    out = out if token_rows is None else token_layout(out, token_rows)
    return out if counts is None else (out, counts)


def local_paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask=None, impl="auto",
                          token_rows=None, tokens=None, counts=None, new_kv=None, projection=None, eps=1e-5):
    """q [B, T, Hq, D], or with `tokens` = T the fused layers' [rows, Hq * D] (row b * T + t); k_pages/
    v_pages [L, N, ps, Hkv, D] (all layers) -> [B, T, Hq, D], or with token_rows that layout,
    [token_rows, Hq * D] (pallas/paged_attention.py). The Triton kernel reads the token layout as it
    is (a slice of the padded rows cost a copy a layer); the other paths slice it. counts: the Triton
    kernel's arrival counts (pallas/paged_attention.py's COUNT_SLOTS zeros), passed from layer to
    layer: given, the result is (output, counts). new_kv: (k, v) [B, Hkv, D] of a decode step's token,
    in no page (defers_kv_write). projection: (x, cos, sin), a decode step whose q is its layer's
    fused projection of x, neither normed nor roped (defers_kv_write; the Triton kernel does both
    and also returns the new K/V: pallas/paged_attention.py).

    impl: 'auto' (the kernels on GPU), 'pallas' (the Triton kernel; interpreted off-GPU), 'fused'
    (attention as 'pallas'; models.llama also fuses its layers), 'ref'
    (the chunked jnp path), 'mosaic' (as 'pallas', but trees and chains of 2 to 64 tokens go to the
    Mosaic GPU verify kernel, verify_hopper.py). 'auto' on Hopper is 'mosaic': it beat the Triton
    kernel at 16, 32 and 64 tokens in every run of kernels-focus-v31..v39, and the engine's outputs
    with it equal the Triton run's (mosaic_engine_check-*)."""
    on_gpu = jax.default_backend() == "gpu"
    if projection is not None:
        from jaxspec.pallas import paged_attention as triton
        return triton.paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, interpret=not on_gpu,
                                       counts=counts, projection=projection, eps=eps)
    rows, q = q, q if tokens is None else _by_request(q, kv_lens.shape[0], tokens, k_pages.shape[-1])
    mosaic = impl == "mosaic" or (impl == "auto" and on_gpu and on_hopper())
    if mosaic and q.shape[1] > 1:
        from jaxspec.pallas import verify_hopper
        if verify_hopper.supports(q, k_pages, tree_mask, pages_per_seq=page_table.shape[1]):
            # persistent CTAs, one an SM: faster than a CTA an item in each of 15 comparisons
            n_sm = getattr(jax.devices()[0], "core_count", 0) if on_gpu else 0
            out = verify_hopper.verify_tree_hopper(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens,
                                                   tree_mask, persistent=n_sm, interpret=not on_gpu)
            return _finish(out, token_rows, counts)
    if _kernels_for(impl) and kernel_supports(q, k_pages, tree_mask):  # it writes the token layout itself
        from jaxspec.pallas import paged_attention as triton  # looked up per call: tests swap it
        return triton.paged_attention(rows, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask,
                                       interpret=not on_gpu, token_rows=token_rows, tokens=tokens, counts=counts,
                                       new_kv=new_kv)
    assert new_kv is None, "new_kv needs the Triton kernel (attention.defers_kv_write)"
    return _finish(paged_attention_chunked(q, k_pages[layer], v_pages[layer], page_table, kv_lens, q_lens, tree_mask),
                   token_rows, counts)


def prefix_attention(q, k_pages, v_pages, layer, page_table, kv_lens, impl="auto"):
    """q [B, T, Hq, D] over each request's first kv_lens cached keys of k_pages/v_pages [L, N, ps,
    Hkv, D] at `layer` -> (out [B, T, Hq, D] float32, base-2 log-sum-exp [B, T, Hq]): the Triton
    kernel's split-K partials where the kernels run (on one device: no mesh), which read only the
    pages in use; else the reference, which gathers the table's whole width."""
    if _kernels_for(impl) and kernel_supports(q, k_pages, None) and jax.sharding.get_abstract_mesh().size <= 1:
        from jaxspec.pallas import paged_attention as triton
        return triton.prefix_attention(q, k_pages, v_pages, layer, page_table, kv_lens,
                                       interpret=jax.default_backend() != "gpu")
    return prefix_attention_ref(q, k_pages[layer], v_pages[layer], page_table, kv_lens)


def paged_attention_chunked(q, k_pages, v_pages, page_table, kv_lens, q_lens, tree_mask=None):
    """paged_attention_ref's function, reading CHUNK_KEYS keys at a time with an online softmax and
    stopping after the batch's longest sequence. k_pages/v_pages [N, ps, Hkv, D]. Off the GPU only:
    there XLA reads a while loop's condition back to the host every iteration."""
    b, t, hq, d = q.shape
    _, ps, hkv, _ = k_pages.shape
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    cp = max(1, min(CHUNK_KEYS // ps, page_table.shape[1]))  # pages a chunk
    table = jnp.pad(page_table, ((0, 0), (0, -page_table.shape[1] % cp)))

    def chunk(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, i * cp, cp, axis=1)
        k = k_pages[pages].reshape(b, cp * ps, hkv, d)
        v = v_pages[pages].reshape(b, cp * ps, hkv, d)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
        ok = visible_mask(kv_lens, q_lens, t, cp * ps, tree_mask, first_key=i * cp * ps)[:, None, None]
        m_new = jnp.maximum(m, jnp.where(ok, s, NEG_INF).max(-1))
        p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)  # a row with nothing visible yet adds 0
        corr = jnp.exp(m - m_new)
        acc = acc * corr[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v,
                                                 preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(-1), acc

    init = (jnp.full((b, hkv, g, t), NEG_INF, jnp.float32), jnp.zeros((b, hkv, g, t), jnp.float32),
            jnp.zeros((b, hkv, g, t, d), jnp.float32))
    keys = jnp.max(kv_lens + q_lens)
    _, l, acc = jax.lax.fori_loop(0, (keys + cp * ps - 1) // (cp * ps), chunk, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)
