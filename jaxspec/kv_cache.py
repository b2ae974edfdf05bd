"""The paged KV cache as an explicit pytree, and the writes into it.

Layout: k, v of shape [layers, num_pages, page_size, kv_heads, head_dim]. A request owns a list of
page ids (its row of the page table); token slot s of the request lives at
(page_table[s // page_size], s % page_size). Page 0 is never allocated: unused page-table entries
point there, so reads need no branch. Padded tokens write nowhere: their page is DROP, which the
scatter skips (mode="drop"). Sending them all to one trash slot instead made every padded write
collide, and XLA serialises colliding scatters on the GPU: a decode step of batch 1024 took
~400 ms instead of 10 (bench/results/step_probe-*.json).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

TRASH_PAGE = 0
DROP_PAGE = 2**30  # out of range: scatters with mode='drop' skip the write


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @classmethod
    def create(cls, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, sharding=None):
        """sharding: where the pages live (sharding.cache_sharding under a mesh), made there: no
        device holds the whole of a sharded cache."""
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        if sharding is None:
            return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return cls(zeros(), zeros())


def slot_coordinates(page_table, kv_lens, q_lens, num_tokens, page_size):
    """(page, offset) for the T new tokens of each request; padding gets DROP_PAGE (not written)."""
    t = jnp.arange(num_tokens)[None, :]
    slot = kv_lens[:, None] + t
    valid = t < q_lens[:, None]
    page_idx = jnp.clip(slot // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, page_idx, axis=1)
    page = jnp.where(valid, page, DROP_PAGE)
    offset = jnp.where(valid, slot % page_size, 0)
    return page, offset


def write_layer(pages, layer, new, page, offset):
    """pages [L, N, ps, kvh, hd]; new [B, T, kvh, hd] -> pages with the new rows written at `layer`.
    Valid slots are unique (a request writes only its own new slots) and padding is dropped."""
    return pages.at[layer, page, offset].set(new.astype(pages.dtype), mode="drop", unique_indices=True)


def write_layers(k_pages, v_pages, kvs, page, offset):
    """write_layer for every layer at once: kvs, each layer's (k, v) [B, T, kvh, hd], in one scatter
    for K and one for V -> (k_pages, v_pages)."""
    k, v = (jnp.stack(x) for x in zip(*kvs))
    put = lambda pages, new: pages.at[:, page, offset].set(new.astype(pages.dtype), mode="drop", unique_indices=True)
    return put(k_pages, k), put(v_pages, v)


def move_slots(cache: KVCache, page_table, kv_lens, src, dst_count):
    """Copy slot kv_len+src[b,i] to kv_len+i for i < dst_count[b] in every layer (tree compaction).

    Reads everything first and writes after, so overlapping moves are safe.
    """
    ps = cache.page_size
    n = src.shape[1]
    i = jnp.arange(n)[None, :]
    src = jnp.where(i < dst_count[:, None], src, i)

    def coords(rel):
        slot = kv_lens[:, None] + rel
        page = jnp.take_along_axis(page_table, jnp.clip(slot // ps, 0, page_table.shape[1] - 1), axis=1)
        return page, slot % ps

    sp, so = coords(src)
    dp, do = coords(jnp.broadcast_to(i, src.shape))
    dp = jnp.where(i < dst_count[:, None], dp, DROP_PAGE)  # no self-copies: they would collide on padding rows
    k = cache.k.at[:, dp, do].set(cache.k[:, sp, so], mode="drop", unique_indices=True)
    v = cache.v.at[:, dp, do].set(cache.v[:, sp, so], mode="drop", unique_indices=True)
    return KVCache(k, v)
