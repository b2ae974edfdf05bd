"""Ancestor masks and depths of draft trees.

A tree of N nodes is given by parent indices (parents[i] < i; -1 for the root and padding). Node i
may attend to node j iff j is i or one of its ancestors; its RoPE position is kv_len + depth(i).
Computed by pointer doubling: ceil(log2 N) rounds of row gathers, no loop over depth, and cheap
next to the target forward it feeds. pack_tree_mask packs it into the bit words the attention
kernels read (a [T, T] tile of it each).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_attention_mask(parents, num_nodes):
    """parents [B, N] i32, num_nodes [B] -> (mask [B, N, N] bool, depth [B, N] i32)."""
    b, n = parents.shape
    idx = jnp.arange(n)
    valid = idx[None] < num_nodes[:, None]
    jump = jnp.where(valid, parents, -1)  # each node's 2^k-th ancestor (-1: none), k = 0 first
    reach = (jump[:, :, None] == idx[None, None, :]) | (idx[:, None] == idx[None, :])[None]
    # pointer doubling: a node reaches what it and its 2^k-th ancestor reached within 2^k steps.
    # Row gathers and ors only: the boolean matrix product this replaces (int32 or bf16) took
    # ~0.4 ms at batch 64 x 64 nodes on the H100 (bench/results/kernels-layout-*.json)
    for _ in range(max(1, (n - 1).bit_length())):
        up = jnp.maximum(jump, 0)
        reach = reach | (jnp.take_along_axis(reach, up[:, :, None], axis=1) & (jump >= 0)[:, :, None])
        jump = jnp.where(jump >= 0, jnp.take_along_axis(jump, up, axis=1), -1)
    depth = reach.sum(-1).astype(jnp.int32) - 1
    return reach, jnp.where(valid, depth, 0)


def capped_depths(parents, cap: int):
    """Each node's depth below node 0, read as cap + 1 where deeper (parents [B, N], parent-first):
    cap + 1 rounds of row gathers, where tree_attention_mask's exact depths take log2(N) rounds over
    [B, N, N] (what cutting a tree to a depth needs, every verify step of the auto policy)."""
    node = jnp.arange(parents.shape[1])[None]
    up = jnp.where(node > 0, parents, 0)
    depth = jnp.zeros(parents.shape, jnp.int32)
    for _ in range(cap + 1):  # after k rounds a node reads min(its depth, k)
        depth = jnp.where(node > 0, jnp.take_along_axis(depth, up, axis=1) + 1, 0)
    return depth


def chain_parents(batch, n):
    """Parents of a chain (each node's parent is the previous one)."""
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (batch, n))


def pack_tree_mask(tree_mask):
    """[B, T, T] bool -> [B, T, 2] int32 bit words (T <= 64)."""
    b, t, _ = tree_mask.shape
    assert t <= 64, "tree verify supports at most 64 query tokens"
    m = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, 64 - t))).reshape(b, t, 2, 32).astype(jnp.uint32)
    words = (m << jnp.arange(32, dtype=jnp.uint32)).sum(-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32)
