"""Pure-jnp paged attention: the reference every Pallas attention kernel is tested against,
and the path used where no kernel applies (CPU, odd shapes).

One function covers extend/prefill (T new tokens, causal among themselves), decode (T = 1) and
tree verify (T draft nodes under a per-request ancestor mask). The new tokens' K/V are already in
the pages (written at slots kv_len .. kv_len + q_len - 1) when this runs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30
LOG2E = 1.4426950408889634  # scores in base 2: the kernels' exponential is exp2


def visible_mask(kv_lens, q_lens, num_queries, num_keys, tree_mask=None, first_key=0):
    """[B, T, S] bool: query t of request b may read key slot first_key + s.

    Slots before kv_len are the cached prefix (always visible). Slot kv_len + j holds new token j:
    visible if j < q_len and (j <= t for a chain, or tree_mask[b, t, j] for a tree).
    """
    s = first_key + jnp.arange(num_keys)[None, None, :]
    t = jnp.arange(num_queries)[None, :, None]
    rel = s - kv_lens[:, None, None]
    if tree_mask is None:
        among_new = rel <= t
    else:
        idx = jnp.clip(rel, 0, num_queries - 1)
        among_new = jnp.take_along_axis(tree_mask, jnp.broadcast_to(idx, (tree_mask.shape[0], num_queries, num_keys)), axis=2)
    return (rel < 0) | ((rel < q_lens[:, None, None]) & among_new)


def paged_attention_ref(q, k_pages, v_pages, page_table, kv_lens, q_lens, tree_mask=None, *,
                        scale=None, softcap=None):
    """q [B, T, Hq, D]; k_pages/v_pages [N, ps, Hkv, D]; page_table [B, P] -> [B, T, Hq, D]."""
    b, t, hq, d = q.shape
    _, ps, hkv, _ = k_pages.shape
    g = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    k = k_pages[page_table].reshape(b, -1, hkv, d)
    v = v_pages[page_table].reshape(b, -1, hkv, d)
    qg = q.reshape(b, t, hkv, g, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = visible_mask(kv_lens, q_lens, t, k.shape[1], tree_mask)
    logits = jnp.where(mask[:, None, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def prefix_attention_ref(q, k_pages, v_pages, page_table, kv_lens):
    """q [B, T, Hq, D] over each request's first kv_lens cached keys; k_pages/v_pages [N, ps, Hkv,
    D] -> (out [B, T, Hq, D] float32, lse [B, T, Hq]: base-2 log-sum-exp of the scores scaled by
    D ** -0.5, NEG_INF where a request has no key). Gathers the page table's whole width."""
    b, t, hq, d = q.shape
    _, ps, hkv, _ = k_pages.shape
    g = hq // hkv
    k = k_pages[page_table].reshape(b, -1, hkv, d)
    v = v_pages[page_table].reshape(b, -1, hkv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, hkv, g, d), k,
                   preferred_element_type=jnp.float32) * (d ** -0.5 * LOG2E)
    ok = (jnp.arange(k.shape[1])[None, :] < kv_lens[:, None])[:, None, None, None]
    m = jnp.where(ok, s, NEG_INF).max(-1)
    p = jnp.where(ok, jnp.exp2(s - m[..., None]), 0.0)
    l = p.sum(-1)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32)) / jnp.maximum(l, 1e-30).transpose(0, 3, 1, 2)[..., None]
    lse = jnp.where(l > 0, m + jnp.log2(jnp.maximum(l, 1e-30)), NEG_INF)
    return out.reshape(b, t, hq, d), lse.transpose(0, 3, 1, 2).reshape(b, t, hq)
