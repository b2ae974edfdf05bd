"""Tree verification, the core every speculative step shares: the target over a draft tree, the
target's own token after each node, the longest matching root path, and the accepted K/V moved
into place. The plain programs (programs.py) and every drafter's step import it from here."""
from __future__ import annotations

import jax.numpy as jnp

from jaxspec import sampling
from jaxspec.kv_cache import move_slots
from jaxspec.pallas.accept import accept_tree
from jaxspec.pallas.tree_mask import capped_depths, tree_attention_mask


def verify_and_accept(model, cache, tokens, parents, page_table, kv_lens, num_nodes, sb, flags, attn_impl,
                      hidden_layers: tuple = (), max_depth: int | None = None):
    """The target over a draft tree, then accept. Shared by every tree-verifying step.

    tokens [B, N]: node 0 is the request's pending token (sampled last step, not yet cached),
    nodes 1.. the draft, in an order where parents come first; parents [B, N] (-1 for the root and
    padding). Returns (emitted tokens [B, N]: accepted drafts then the bonus token, their count
    [B], logprobs, top-n values, top-n ids, the accepted path [B, N], the target's final hidden
    [B, N, H] and hidden_layers' states, the cache with the accepted path's K/V moved into place).
    max_depth: a static bound on the tree's depth + 1, where the drafter knows one (sampling.sample).
    """
    mask, depth = tree_attention_mask(parents, num_nodes)
    h, cache, layers = model(tokens, kv_lens[:, None] + depth, cache, page_table, kv_lens, num_nodes, tree_mask=mask,
                             hidden_layers=hidden_layers, attn_impl=attn_impl)
    logits = model.logits(h)  # [B, N, V]
    extra = None
    if flags.penalties:  # each node's penalty sees the draft tokens above it
        n = tokens.shape[1]
        anc = mask & ~jnp.eye(n, dtype=bool)[None] & (jnp.arange(n)[None, None] > 0)
        extra = jnp.where(anc, tokens[:, None, :], -1)
    target = sampling.sample(logits, sb, flags, extra, depth, max_depth)  # the target's own token after each node
    path, num_accepted = accept_tree(tokens, parents, target, num_nodes, mask, depth)
    # Along the accepted path target[path[i]] == tokens[path[i + 1]], so the emitted tokens (the
    # accepted drafts, then the bonus) are simply the target's tokens at the path's nodes.
    count = num_accepted + 1
    out = jnp.where(jnp.arange(tokens.shape[1])[None] < count[:, None], jnp.take_along_axis(target, path, axis=1), 0)
    lp, top_v, top_i = sampling.logprobs_of(jnp.take_along_axis(logits, path[:, :, None], axis=1), out,
                                            flags.top_logprobs)
    cache = move_slots(cache, page_table, kv_lens, path, count)
    return out, count, lp, top_v, top_i, path, h, layers, cache


def cut_counts(parents, num_nodes, path, count, cuts: tuple):
    """What each cut of a verified tree would have emitted, for the policy's accept statistics:
    parents [B, N] and num_nodes [B] of the trees verified, path [B, N] and count [B] of what they
    accepted (verify_and_accept), cuts ((max_depth, max_nodes), ...) as cut_drafts takes them.
    Returns [B, len(cuts)]: the tokens a row would have emitted had only the cut's nodes been
    verified (0 for a row that verified nothing). A cut keeps its parents (they come first and are
    shallower), so its accepted nodes are the accepted path's first ones it keeps; the token after
    the last of them is the target's own, whichever tree was verified (the same draw: exact for
    greedy and sampled targets alike)."""
    if not cuts:
        return jnp.zeros((parents.shape[0], 0), jnp.int32)
    depth = capped_depths(parents, max(d for d, _ in cuts))
    node = jnp.arange(parents.shape[1])[None]
    live = node < num_nodes[:, None]
    on_path = (node >= 1) & (node < count[:, None])  # path[:, 1:count] are the accepted drafts
    out = []
    for max_depth, max_nodes in cuts:
        shallow = live & (depth <= max_depth)
        keep = shallow & (jnp.cumsum(shallow, axis=1) <= max_nodes)
        out.append(1 + jnp.sum(on_path & jnp.take_along_axis(keep, path, axis=1), axis=1, dtype=jnp.int32))
    return jnp.where(count[:, None] > 0, jnp.stack(out, axis=1), 0)
