"""Ancestor masks and depths of draft trees.

A tree of N nodes is given by parent indices (parents[i] < i; -1 for the root and padding). Node i
may attend to node j iff j is i or one of its ancestors; its RoPE position is kv_len + depth(i).
Computed by repeated squaring of the reachability matrix: ceil(log2 N) boolean matmuls, no loop
over depth, and cheap next to the target forward it feeds. Bit-packing is left to the attention
kernel, which only ever reads a [T, T] tile of this.
"""
from __future__ import annotations

import jax.numpy as jnp


def tree_attention_mask(parents, num_nodes):
    """parents [B, N] i32, num_nodes [B] -> (mask [B, N, N] bool, depth [B, N] i32)."""
    b, n = parents.shape
    idx = jnp.arange(n)
    valid = idx[None] < num_nodes[:, None]
    par = jnp.where(valid, parents, -1)
    reach = (par[:, :, None] == idx[None, None, :]) | (idx[:, None] == idx[None, :])[None]
    for _ in range(max(1, (n - 1).bit_length())):
        # 0/1 in bf16 with float32 sums (at most N <= 64: exact): a tensor-core product, where an
        # int32 one took ~0.3 ms at batch 64 x 64 nodes on the H100 (bench/results/kernels-*.json)
        r = reach.astype(jnp.bfloat16)
        reach = jnp.einsum("bij,bjk->bik", r, r, preferred_element_type=jnp.float32) > 0.5
    depth = reach.sum(-1).astype(jnp.int32) - 1
    return reach, jnp.where(valid, depth, 0)


def chain_parents(batch, n):
    """Parents of a chain (each node's parent is the previous one)."""
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (batch, n))
