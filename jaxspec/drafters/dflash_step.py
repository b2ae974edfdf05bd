"""DFLASH's fused step: target verify of the drafted block -> accept -> the drafter's context K/V
for the accepted positions -> the next block drafted in one pass, one jitted program with both
caches donated (SGLang's DFLASH worker runs these as separate forwards; seed 003).

The draft is a chain, the block [root, d_1 .. d_{n-1}] verified as a tree whose node i has parent
i - 1, or (topk > 1) a tree built from the block's per-position distributions; either goes
through the same verify_and_accept as every drafter, so sampling stays lossless (drafts are
proposals; the target's own sample decides each position).

The drafter's cache, per drafter layer, in the target's pages: slot p < kv_len holds K/V
projected from the target's features at position p. A draft pass writes the block's own K/V at
slots P .. P + n - 1 (P = the committed length) and attends over slots [0, P + n) with the block
fully visible to itself; the next step's context K/V overwrite those slots as positions commit.
Only accepted positions get context K/V (seed 004's skip of dead positions, here for free).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import attention, sampling
from jaxspec.drafters.eagle_step import coupled, first_round, next_inputs, next_round, select_tree, with_root
from jaxspec.kv_cache import KVCache, slot_coordinates, write_layer, write_layers
from jaxspec.models.llama import rope_frequencies, rope_table
from jaxspec.programs import decode_loop
from jaxspec.verify import verify_and_accept


def write_context(head, dcache: KVCache, features, page_table, kv_lens, q_lens):
    """Context K/V for positions kv_len .. kv_len + q_len - 1 of each row, from the target's
    selected layer outputs there (features [len(ids), B, T, H]), into every drafter layer."""
    t = features.shape[2]
    ctx = head.context(features)
    rope = rope_table(kv_lens[:, None] + jnp.arange(t)[None], rope_frequencies(head.cfg))
    page, offset = slot_coordinates(page_table, kv_lens, q_lens, t, dcache.page_size)
    # every drafter layer's K/V in one scatter each (a plain step that keeps the drafter in step
    # paid 2 scatters a drafter layer)
    return KVCache(*write_layers(dcache.k, dcache.v, [layer.kv(ctx, rope) for layer in head.layers], page, offset))


def draft_block(head, target, dcache: KVCache, page_table, prefix_len, root, live, tree, attn_impl, coupling=None):
    """The next draft from one pass over the block [root, mask x tree.steps] at positions
    prefix_len.. (root [B]: the pending token). tree.topk 1: a chain of the drafter's argmax at
    block positions 1 .. num_draft_tokens - 1 (coupling: as eagle_step.draft_tree's, block
    position i drafting the token drawn at output position coupling[1] + i - 1). topk > 1: a tree
    (tree_from_marginals). Rows not live write nothing. Returns ((tokens, parents) [B, N], cache)."""
    b, width = root.shape[0], tree.steps + 1
    tokens = jnp.concatenate([root[:, None].astype(jnp.int32), jnp.full((b, width - 1), head.cfg.mask_token, jnp.int32)], 1)
    q_lens = jnp.where(live, width, 0).astype(jnp.int32)
    rope = rope_table(prefix_len[:, None] + jnp.arange(width)[None], rope_frequencies(head.cfg))
    page, offset = slot_coordinates(page_table, prefix_len, q_lens, width, dcache.page_size)
    everything = jnp.ones((b, width, width), bool)  # non-causal inside the block
    kp, vp = dcache.k, dcache.v
    x = target.embed_tokens(tokens)
    for li, layer in enumerate(head.layers):
        q, k, v = layer.qkv(x, rope)
        kp, vp = write_layer(kp, li, k, page, offset), write_layer(vp, li, v, page, offset)
        o = attention.paged_attention(q, kp, vp, li, page_table, prefix_len, q_lens, everything, impl=attn_impl)
        x = layer.finish(x, o)
    # a chain reads only its first n - 1 block positions: a short chain of a long block (15:1:4 at
    # large batches) leaves most of the [B, steps, V] float32 logits unwritten
    drafted_positions = tree.num_draft_tokens - 1 if tree.topk == 1 else width - 1
    logits = head.logits(target, x[:, 1:1 + drafted_positions])  # [B, drafted_positions, V]
    coupled_logits = logits
    if coupling is not None:
        sb, first = coupling
        pos = first[:, None] + jnp.arange(drafted_positions)[None]
        coupled_logits = sampling.coupled_draft_logits(logits, sb, pos, logits.shape[-1])
    if tree.topk == 1:
        n = tree.num_draft_tokens
        drafted = jnp.argmax(coupled_logits, axis=-1).astype(jnp.int32)
        return with_root(root, drafted, jnp.broadcast_to(jnp.arange(n - 1, dtype=jnp.int32), (b, n - 1))), KVCache(kp, vp)
    lp = jax.nn.log_softmax(logits)
    if coupling is not None:  # a sampled row's draw ranks first at each position, as in draft_tree
        drawn = jnp.argmax(coupled_logits, -1)
        promote = (jnp.arange(lp.shape[-1]) == drawn[..., None]) & (coupling[0].temperature > 0)[:, None, None]
        lp = jnp.where(promote, jnp.max(lp, axis=-1, keepdims=True) + 1e-3, lp)
    return tree_from_marginals(lp, root, tree), KVCache(kp, vp)


def tree_from_marginals(lp, root, tree):
    """EAGLE-2's tree (eagle_step.draft_tree's rounds and selection) from one block's per-position
    log-probs lp [B, steps, V]: the block is drafted in one pass, so every node at depth d expands
    by the same distribution lp[:, d - 1] (Medusa's independence), whatever its ancestors."""
    b, k = lp.shape[0], tree.topk
    top_lp, top_tok = jax.lax.top_k(lp, k)  # [B, steps, k]
    score = top_lp[:, 0]
    cands, frontier_id = first_round(score, top_tok[:, 0])
    for s in range(1, tree.steps):
        every = lambda x: jnp.broadcast_to(x[:, s, None, :], (b, k, k))  # the same children for each frontier node
        score, _, frontier_id = next_round(cands, score, frontier_id, every(top_lp), every(top_tok))
    tokens, parents = select_tree(cands, tree.num_draft_tokens)
    return with_root(root, tokens.astype(jnp.int32), parents)


def extend(graphs, tree, attn_impl, state, cache, tokens, next_tokens, page_table, kv_lens, q_lens, sb, flags):
    """A prefill chunk with the drafter's context written for it and the next block drafted (used
    by the rows whose prompt this chunk ends). Returns what eagle_step.extend returns."""
    target, head = nnx.merge(graphs[0], state[0]), nnx.merge(graphs[1], state[1])
    tcache, dcache = cache
    t = tokens.shape[1]
    positions = kv_lens[:, None] + jnp.arange(t)[None]
    h, tcache, layers = target(tokens, positions, tcache, page_table, kv_lens, q_lens,
                               hidden_layers=head.cfg.target_layer_ids, attn_impl=attn_impl)
    logits = target.logits(jnp.take_along_axis(h, jnp.maximum(q_lens - 1, 0)[:, None, None], axis=1))
    nxt = sampling.sample(logits, sb, flags)[:, 0]
    lp, top_v, top_i = sampling.logprobs_of(logits, nxt[:, None], flags.top_logprobs)
    follow = jnp.where(next_tokens >= 0, next_tokens, nxt)
    dcache = write_context(head, dcache, layers, page_table, kv_lens, q_lens)
    tree_out, dcache = draft_block(head, target, dcache, page_table, kv_lens + q_lens, follow, q_lens > 0, tree,
                                   attn_impl, coupled(sb, flags, sb.step + 1))
    squeeze = (lambda x: None if x is None else x[:, 0])
    return nxt, lp[:, 0], squeeze(top_v), squeeze(top_i), tree_out, nxt[:, None], (tcache, dcache)


def verify(graphs, tree, attn_impl, state, cache, tokens, parents, page_table, kv_lens, num_nodes, sb, flags):
    """Verify the drafted block, accept, write the accepted positions' context K/V and draft the
    next block. Returns what eagle_step.verify returns (the chained call's inputs included)."""
    target, head = nnx.merge(graphs[0], state[0]), nnx.merge(graphs[1], state[1])
    tcache, dcache = cache
    out, count, lp, top_v, top_i, path, _, layers, tcache = verify_and_accept(
        target, tcache, tokens, parents, page_table, kv_lens, num_nodes, sb, flags, attn_impl,
        hidden_layers=head.cfg.target_layer_ids, max_depth=tree.steps + 1)
    count = jnp.where(num_nodes > 0, count, 0)  # a row with no nodes (stopped in verify_steps) emits nothing
    accepted = jnp.take_along_axis(layers, path[None, :, :, None], axis=2)
    dcache = write_context(head, dcache, accepted, page_table, kv_lens, count)
    rows = jnp.arange(tokens.shape[0])
    root = out[rows, jnp.maximum(count - 1, 0)]
    tree_out, dcache = draft_block(head, target, dcache, page_table, kv_lens + count, root, count > 0, tree,
                                   attn_impl, coupled(sb, flags, sb.step + count))
    chained = next_inputs(tree_out, tokens.shape[1], kv_lens, count, sb)
    return out, count, lp, top_v, top_i, tree_out, chained, path, (tcache, dcache)


def decode(graphs, attn_impl, state, cache, tokens, page_table, kv_lens, budget, stop_ids, num_steps, sb, flags):
    """Plain decode steps (programs.decode_loop) that keep the drafter's context in step, for the
    auto policy's plain decoding: each writes the context K/V of the fed token's position. No block
    is drafted: the next verify call verifies each root alone, then drafts from it. Outputs as
    programs._decode's, with both caches."""
    target, head = nnx.merge(graphs[0], state[0]), nnx.merge(graphs[1], state[1])

    def forward(cache, tok, kv, q):
        h, tcache, layers = target(tok, kv[:, None], cache[0], page_table, kv, q,
                                   hidden_layers=head.cfg.target_layer_ids, attn_impl=attn_impl)
        return target.logits(h), (tcache, write_context(head, cache[1], layers, page_table, kv, q)), None
    return decode_loop(forward, None, cache, tokens, kv_lens, budget, stop_ids, num_steps, sb, flags)
