"""Accepting a draft tree against the target's own tokens.

target[b, i] is the token the target produces after node i: its argmax (greedy) or a draw from
its processed distribution (sampling). Starting at the root, move to the child whose draft token
equals the target's token at the current node, until no child matches. With sampled target tokens
this is SGLang's target-only tree speculative sampling: every emitted token is a draw from the
target given its prefix, so the output distribution is exactly the target's (siblings carry
distinct tokens, which the drafters guarantee).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def accept_tree(tokens, parents, target, num_nodes):
    """tokens/parents/target [B, N], num_nodes [B] -> (path [B, N], num_accepted [B]).

    path[:, 0] = 0 (the root); path[:, i] for 1 <= i <= num_accepted are the accepted nodes; the
    rest is filled with i so that compacting the K/V leaves those slots alone.
    """
    b, n = tokens.shape
    idx = jnp.arange(n)[None]
    live = idx < num_nodes[:, None]

    def body(i, carry):
        path, cur, count, done = carry
        want = jnp.take_along_axis(target, cur[:, None], axis=1)
        match = live & (parents == cur[:, None]) & (tokens == want) & (idx > 0)
        found = match.any(axis=1) & ~done
        child = jnp.argmax(match, axis=1).astype(jnp.int32)
        path = path.at[:, i].set(jnp.where(found, child, path[:, i]))
        return path, jnp.where(found, child, cur), count + found, done | ~found

    init = (jnp.broadcast_to(idx, (b, n)).astype(jnp.int32), jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32),
            jnp.zeros(b, bool))
    path, _, count, _ = jax.lax.fori_loop(1, n, body, init)
    return path, count


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
