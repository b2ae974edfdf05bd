"""Accepting a draft tree against the target's own tokens.

target[b, i] is the token the target produces after node i: its argmax (greedy) or a draw from
its processed distribution (sampling). Starting at the root, move to the child whose draft token
equals the target's token at the current node, until no child matches. With sampled target tokens
this is SGLang's target-only tree speculative sampling: every emitted token is a draw from the
target given its prefix, so the output distribution is exactly the target's (siblings carry
distinct tokens, which the drafters guarantee).
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxspec.pallas.tree_mask import tree_attention_mask


def accept_tree(tokens, parents, target, num_nodes, mask=None, depth=None):
    """tokens/parents/target [B, N], num_nodes [B] -> (path [B, N], num_accepted [B]); mask and
    depth: the trees' ancestor masks and depths (tree_attention_mask), computed here if not given.

    path[:, 0] = 0 (the root); path[:, i] for 1 <= i <= num_accepted are the accepted nodes; the
    rest is filled with i so that compacting the K/V leaves those slots alone.

    No loop over depth: a node is accepted iff it and each of its ancestors below the root is the
    first child of its parent whose token is the target's token after that parent. (A loop walking
    down the tree costs a handful of kernel launches per level, and launches bound a small
    model's step.)
    """
    n = tokens.shape[1]
    if mask is None:
        mask, depth = tree_attention_mask(parents, num_nodes)
    idx = jnp.arange(n)
    live = (idx[None] < num_nodes[:, None]) & (idx[None] > 0) & (parents >= 0)
    want = jnp.take_along_axis(target, jnp.maximum(parents, 0), axis=1)  # the target's token after j's parent
    match = live & (tokens == want)
    # siblings carry distinct tokens; should two match anyway, the first one is taken
    earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & (idx[None, :] < idx[:, None])[None]
    match &= ~(earlier_sibling & match[:, None, :]).any(-1)
    # accepted: no node on the root path (itself included, the root excluded) fails to match
    accepted = match & ~(mask & ~match[:, None, :] & (idx > 0)[None, None, :]).any(-1)
    at_depth = accepted[:, None, :] & (depth[:, None, :] == idx[None, :, None])  # [B, depth, node]
    path = jnp.where(at_depth.any(-1), jnp.argmax(at_depth, axis=-1), idx[None]).astype(jnp.int32)
    return path, accepted.sum(-1).astype(jnp.int32)


def accept_tree_ref(tokens, parents, target, num_nodes):
    """Plain-Python reference for tests."""
    import numpy as np
    tokens, parents, target, num_nodes = map(np.asarray, (tokens, parents, target, num_nodes))
    b, n = tokens.shape
    path = np.tile(np.arange(n), (b, 1))
    count = np.zeros(b, np.int32)
    for r in range(b):
        cur = 0
        while True:
            kids = [j for j in range(1, num_nodes[r]) if parents[r, j] == cur and tokens[r, j] == target[r, cur]]
            if not kids:
                break
            cur = kids[0]
            count[r] += 1
            path[r, count[r]] = cur
    return path, count
