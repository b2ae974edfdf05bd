"""The paged KV cache as an explicit pytree, and the writes into it.

Layout: k, v of shape [layers, num_pages, page_size, kv_heads, head_dim]. A request owns a list of
page ids (its row of the page table); token slot s of the request lives at
(page_table[s // page_size], s % page_size). Page 0 is never allocated: padded tokens write there
and unused page-table entries point there, so no write needs a branch.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

TRASH_PAGE = 0


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
    def create(cls, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype):
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def slot_coordinates(page_table, kv_lens, q_lens, num_tokens, page_size):
    """(page, offset) for the T new tokens of each request; padding goes to the trash page."""
    t = jnp.arange(num_tokens)[None, :]
    slot = kv_lens[:, None] + t
    valid = t < q_lens[:, None]
    page_idx = jnp.clip(slot // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, page_idx, axis=1)
    page = jnp.where(valid, page, TRASH_PAGE)
    offset = jnp.where(valid, slot % page_size, 0)
    return page, offset


def write_layer(pages, layer, new, page, offset):
    """pages [L, N, ps, kvh, hd]; new [B, T, kvh, hd] -> pages with the new rows written at `layer`.

    JAXSPEC_UNIQUE_SCATTER=1 declares the slots unique (only trash-page padding repeats, and which
    padding row wins there does not matter); under test on the H100 (bench/scatter_probe.py)."""
    unique = os.environ.get("JAXSPEC_UNIQUE_SCATTER", "0") == "1"
    return pages.at[layer, page, offset].set(new.astype(pages.dtype), unique_indices=unique)


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
    k = cache.k.at[:, dp, do].set(cache.k[:, sp, so])
    v = cache.v.at[:, dp, do].set(cache.v[:, sp, so])
    return KVCache(k, v)
