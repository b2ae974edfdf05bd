"""EAGLE's fused step: target verify -> accept -> KV compaction -> draft catch-up -> next draft tree,
one jitted program with the target and draft caches donated (the JAX analogue of SGLang's one CUDA
graph per batch size; seed 000's naive EAGLE is the configuration steps=1, topk=1, tokens=2).

The draft cache holds one K/V row per committed position, in the target's pages (same page table,
its own one-layer storage). Slot i holds the pair (feature_i, token_{i+1}): the target's feature
at position i with the token that followed it; its output predicts token_{i+2}. After a verify
step accepted `count` tokens, exactly those `count` pairs are new, so the catch-up runs the head
on them alone (q_len = count: the rejected tree positions are never drafted, seed 004's skip).

Drafting the next tree is EAGLE-2's dynamic tree, as SGLang builds it: `steps` rounds; each
expands the `topk` best frontier nodes by their `topk` best children, and keeps the `topk` children
with the highest cumulative log-probability as the next frontier; finally the `num_draft_tokens-1`
best candidates overall become the tree. A child never outscores its parent, so the chosen set is
closed under parents, and candidates are numbered in creation order, so sorting puts parents first.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import attention, sampling
from jaxspec.attention import NEG_INF
from jaxspec.kv_cache import KVCache, slot_coordinates, write_layer
from jaxspec.pallas.attention_ref import LOG2E
from jaxspec.pallas.top_k import top_k_log_softmax
from jaxspec.programs import decode_loop, steps_while_alive
from jaxspec.verify import cut_counts, verify_and_accept


@dataclasses.dataclass(frozen=True)
class TreeShape:
    steps: int = 3  # speculative_num_steps: tree depth
    topk: int = 4  # speculative_eagle_topk: branching per step
    num_draft_tokens: int = 8  # speculative_num_draft_tokens: verified nodes, the root included

    def __post_init__(self):
        if self.steps < 1 or self.topk < 1 or self.num_draft_tokens < 2:
            raise ValueError(f"invalid tree: steps={self.steps}, topk={self.topk}, num_draft_tokens={self.num_draft_tokens} "
                             "(need steps >= 1, topk >= 1, num_draft_tokens >= 2)")
        most = 1 + self.topk + (self.steps - 1) * self.topk ** 2
        if self.num_draft_tokens > most:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} exceeds the {most} nodes that steps={self.steps}, "
                             f"topk={self.topk} can draft")
        if self.topk == 1 and self.num_draft_tokens > self.steps + 1:
            raise ValueError(f"a chain (topk=1) of {self.steps} steps drafts {self.steps} tokens; "
                             f"num_draft_tokens={self.num_draft_tokens} needs steps >= {self.num_draft_tokens - 1}")

    @property
    def label(self) -> str:
        """steps:topk:num_draft_tokens, as the command lines and benches write a tree."""
        return f"{self.steps}:{self.topk}:{self.num_draft_tokens}"

    @classmethod
    def parse(cls, label: str) -> "TreeShape":
        return cls(*(int(x) for x in label.split(":")))


def nodes_that_fit(num_nodes: int, max_tokens: int, rows: int, min_nodes: int) -> int:
    """Nodes a step verifies for each of `rows` rows within max_tokens over them all: the tree cut
    to fit, or 1 (decode plainly) where the cut leaves fewer than min_nodes (a tree smaller than
    min_nodes is kept whole). The engine's rule by batch bucket, and the rollout's by batch."""
    nodes = min(num_nodes, max_tokens // max(rows, 1))
    return nodes if nodes >= min(min_nodes, num_nodes) else 1


def write_pairs(head, target, dcache: KVCache, feats, next_tokens, page_table, kv_lens, q_lens):
    """The head's K/V of pairs (feats[:, i], next_tokens[:, i]) written at slots kv_len + i,
    i < q_len: (their queries, the head's residual, the draft cache)."""
    t = next_tokens.shape[1]
    positions = kv_lens[:, None] + jnp.arange(t)[None]
    q, k, v, res = head.qkv(target.embed_tokens(next_tokens), feats, positions)
    page, offset = slot_coordinates(page_table, kv_lens, q_lens, t, dcache.page_size)
    return q, res, KVCache(write_layer(dcache.k, 0, k, page, offset), write_layer(dcache.v, 0, v, page, offset))


def catch_up(head, target, dcache: KVCache, feats, next_tokens, page_table, kv_lens, q_lens, attn_impl):
    """Run the head on pairs (feats[:, i], next_tokens[:, i]) at slots kv_len + i, i < q_len, writing
    the draft cache; returns the head's outputs [B, T, H] and the cache."""
    q, res, dcache = write_pairs(head, target, dcache, feats, next_tokens, page_table, kv_lens, q_lens)
    o = attention.paged_attention(q, dcache.k, dcache.v, 0, page_table, kv_lens, q_lens, None, impl=attn_impl)
    return head.finish(o, res), dcache


def attend_drafted(q, keys, values, visible, prefix):
    """q [B, K, Hq, D] over the cached prefix and the drafted rows keys/values [B, S, Hkv, D] where
    visible [B, K, S]. prefix: the queries' attention over the prefix alone, (out [B, K, Hq, D],
    base-2 log-sum-exp [B, K, Hq]) from attention.prefix_attention, merged here with the drafted
    rows' scores as one softmax.

    The prefix is read by the paged kernel, which stops at each row's length, where it was gathered
    over the page table's whole width (as wide as the longest sequence admitted: 8192 tokens for a
    server at SmolLM2's context) and shared by the rounds. At batch 1 on the H100 a 6:8:48 tree
    then ran at 2.07x / 2.06x plain on MT-bench / HumanEval (spec-b1-wide-), against 1.77x / 1.76x
    with the gather (spec-head6-, an earlier run); 6:4:24's step moved less than its spread between
    runs (engine_step_gap-*)."""
    b, kq, hq, d = q.shape
    hkv = keys.shape[2]
    g = hq // hkv
    scores = jnp.einsum("bqhgd,bshd->bhgqs", q.reshape(b, kq, hkv, g, d), keys,
                        preferred_element_type=jnp.float32) * (d ** -0.5 * LOG2E)
    ok = visible[:, None, None]
    out_p, lse_p = prefix
    lse_p = lse_p.reshape(b, kq, hkv, g).transpose(0, 2, 3, 1)  # [B, Hkv, G, K]
    m = jnp.maximum(jnp.where(ok, scores, NEG_INF).max(-1), lse_p)
    p = jnp.where(ok, jnp.exp2(scores - m[..., None]), 0.0)
    w_p = jnp.exp2(lse_p - m)  # the prefix's share: its softmax mass against the row's max
    o = jnp.einsum("bhgqs,bshd->bqhgd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    o = o + out_p.reshape(b, kq, hkv, g, d) * w_p.transpose(0, 3, 1, 2)[..., None]
    denom = (p.sum(-1) + w_p).transpose(0, 3, 1, 2)[..., None]
    return (o / jnp.maximum(denom, 1e-30)).reshape(b, kq, hq, d).astype(q.dtype)


def draft_tree(head, target, dcache: KVCache, page_table, prefix_len, last_out, root, tree: TreeShape,
               coupling=None, attn_impl="auto"):
    """Draft the next tree from the head's output at the last committed slot (prefix_len - 1).

    last_out [B, H]; root [B] the pending token. coupling: None (greedy), or (sampling batch,
    output position [B] of the token the target draws at the root). A sampled row's first child
    at each node is then the token the target's draw there picks if the head is right about its
    distribution (sampling.coupled_draft_logits), scored as the node's most probable child; the
    others are the head's most probable tokens, as for a greedy row: with every child coupled, a
    head less sure than the target covers less of the draw's likely tokens (on the tiny test model
    and on SmolLM2 at T=1 it was accepted less often). Returns tokens [B, N] (node 0 = root) and
    parents [B, N] (-1 at the root), N = tree.num_draft_tokens, in parent-first order.
    """
    b = root.shape[0]
    k, n = tree.topk, tree.num_draft_tokens
    draft_ids = None if head.borrows_target_head else head.to_target(jnp.arange(head.cfg.draft_vocab_size))

    def best_children(out, depth):
        """The k best draft ids after each row of `out` and their log-probs; a sampled row's
        coupled draw ranked first."""
        logits = head.logits(target, out)
        promote = None
        if coupling is not None:
            sb, first = coupling
            drawn = jnp.argmax(sampling.coupled_draft_logits(logits, sb, first + depth, target.cfg.vocab_size,
                                                              draft_ids), -1)
            promote = jnp.where((sb.temperature > 0).reshape((-1,) + (1,) * (drawn.ndim - 1)), drawn, -1)
        return top_k_log_softmax(logits, k, promote)

    score, tok = best_children(last_out, 0)  # [B, k]
    cands, frontier_id = first_round(score, tok)
    hidden = jnp.broadcast_to(last_out[:, None], (b, k, last_out.shape[-1]))
    # the drafted rows' keys and values (the prefix stays in the pages), grown by concatenation, and
    # which of them each frontier node sees: its ancestors and itself. An in-place write into a
    # fixed buffer became, for a chain (k = 1), an asynchronous dynamic-update-slice that no
    # command buffer holds, so XLA ran the whole verify loop from the host: a batch-1 3:1:4 call's
    # launch held the host 7.0 ms, 1.76 ms a step, against 1.19 ms and 1.29 ms with the
    # concatenation (H200: loop_commands-before- against -after-).
    keys, values, visible = [], [], jnp.zeros((b, k, 0), bool)
    for s in range(1, tree.steps):
        pos = jnp.broadcast_to((prefix_len + s - 1)[:, None], (b, k))
        q, kk, vv, res = head.qkv(target.embed_tokens(head.to_target(tok)), hidden, pos)
        keys.append(kk.astype(dcache.k.dtype))
        values.append(vv.astype(dcache.v.dtype))
        visible = jnp.concatenate([visible, jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k))], axis=2)
        prefix = attention.prefix_attention(q, dcache.k, dcache.v, 0, page_table, prefix_len, impl=attn_impl)
        out = head.finish(attend_drafted(q, jnp.concatenate(keys, 1), jnp.concatenate(values, 1), visible, prefix),
                          res)
        child_lp, child_tok = best_children(out, s)  # [B, k, k]
        score, pick, frontier_id = next_round(cands, score, frontier_id, child_lp, child_tok)
        row = pick // k
        tok = jnp.take_along_axis(child_tok.reshape(b, k * k), pick, axis=1)
        hidden = jnp.take_along_axis(out, row[:, :, None], axis=1)
        visible = jnp.take_along_axis(visible, row[:, :, None], axis=1)
    tokens, parents = select_tree(cands, n)
    return with_root(root, head.to_target(tokens).astype(jnp.int32), parents)


def first_round(score, tok):
    """EAGLE-2's candidates after the root's k best children (score, tok [B, k]): (cands, the
    frontier's candidate ids). cands: lists of [B, *] per round of cumulative log-prob, token and
    parent's candidate id (-1: the root), candidates numbered in creation order."""
    b, k = score.shape
    return ([score], [tok], [jnp.full((b, k), -1, jnp.int32)]), jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))


def next_round(cands, score, frontier_id, child_lp, child_tok):
    """One EAGLE-2 round: each of the k frontier nodes (cumulative log-probs score [B, k]) takes
    its k best children (child_lp, child_tok [B, k, k]); all k*k join cands and the k best are the
    next frontier. Returns (their scores, their index among the k*k, their candidate ids)."""
    b, k = score.shape
    first_id = sum(c.shape[1] for c in cands[0])
    expanded = (score[:, :, None] + child_lp).reshape(b, k * k)
    cands[0].append(expanded)
    cands[1].append(child_tok.reshape(b, k * k))
    cands[2].append(jnp.repeat(frontier_id, k, axis=1))
    score, pick = jax.lax.top_k(expanded, k)
    return score, pick, first_id + pick


def select_tree(cands, n: int):
    """The n - 1 best of cands (first_round's) as drafted nodes 1 .. n-1, best first: tokens and
    parents' node indices. A child scores at most its parent (ties go to the lower id, the parent),
    so parents come first, and any first m nodes are the best m-node tree: the cut of a tree to a
    smaller shape (device.cut_drafts, verify.cut_counts) is what that shape would select. (In creation
    order a cut kept the shallow nodes: shape_links.py.)"""
    all_score, all_tok, all_parent = (jnp.concatenate(c, axis=1) for c in cands)
    _, sel = jax.lax.top_k(all_score, n - 1)
    par_c = jnp.take_along_axis(all_parent, sel, axis=1)
    par_pos = jnp.argmax(sel[:, None, :] == par_c[:, :, None], axis=-1)
    parents = jnp.where(par_c < 0, 0, par_pos + 1).astype(jnp.int32)
    return jnp.take_along_axis(all_tok, sel, axis=1), parents


def with_root(root, tokens, parents):
    """Node 0 (the pending token, parent -1) before the drafted nodes."""
    b = root.shape[0]
    return (jnp.concatenate([root[:, None].astype(jnp.int32), tokens], axis=1),
            jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parents], axis=1))


def coupled(sb, flags, first_pos):
    """draft_tree's coupling for a program that samples: the next tree's root is drawn at output
    position first_pos (after an extend: the token after the one it sampled; after a verify: the
    token after the `count` it emitted)."""
    return (sb, first_pos) if flags.sample else None


# -- the two programs ----------------------------------------------------------------------------------
def extend(graphs, tree: TreeShape, attn_impl, state, cache, tokens, next_tokens, page_table, kv_lens, q_lens,
           sb, flags):
    """Prefill chunk with the head kept in step, and the next tree drafted (used by the rows whose
    prompt this chunk ends).

    next_tokens [B]: the token after each row's chunk when the host knows it (the next prompt
    chunk's first), else -1 and the token sampled here is used. Returns (next token, logprob, top-n
    values, top-n ids, (tree tokens, parents), next token [B, 1], (target cache, draft cache)).
    """
    target, head = nnx.merge(graphs[0], state[0]), nnx.merge(graphs[1], state[1])
    tcache, dcache = cache
    b, t = tokens.shape
    positions = kv_lens[:, None] + jnp.arange(t)[None]
    h, tcache, layers = target(tokens, positions, tcache, page_table, kv_lens, q_lens,
                               hidden_layers=head.cfg.feature_layers, attn_impl=attn_impl)
    last_i = jnp.maximum(q_lens - 1, 0)
    logits = target.logits(jnp.take_along_axis(h, last_i[:, None, None], axis=1))
    nxt = sampling.sample(logits, sb, flags)[:, 0]
    lp, top_v, top_i = sampling.logprobs_of(logits, nxt[:, None], flags.top_logprobs)
    follow = jnp.where(next_tokens >= 0, next_tokens, nxt)
    rows = jnp.arange(b)
    pair_tokens = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1).at[rows, last_i].set(follow)
    out, dcache = catch_up(head, target, dcache, head.features(h, layers), pair_tokens, page_table, kv_lens, q_lens,
                           attn_impl)
    tree_out = draft_tree(head, target, dcache, page_table, kv_lens + q_lens, out[rows, last_i], follow, tree,
                          coupled(sb, flags, sb.step + 1), attn_impl)
    squeeze = (lambda x: None if x is None else x[:, 0])
    return nxt, lp[:, 0], squeeze(top_v), squeeze(top_i), tree_out, nxt[:, None], (tcache, dcache)


def verify(graphs, tree: TreeShape, attn_impl, state, cache, tokens, parents, page_table, kv_lens, num_nodes, sb,
           flags):
    """Verify the drafted tree, accept, compact the target's K/V, catch the head up on the accepted
    tokens and draft the next tree. Returns (emitted tokens [B, N], count [B], logprobs, top-n
    values, top-n ids, (next tree tokens, parents), the next step's (tokens, parents, kv_lens,
    sampling batch), the accepted path [B, N], (target cache, draft cache)). The next step's inputs take the buffers of this
    step's (Programs donates them), so a chain of steps keeps its buffers and XLA's recorded
    command buffer needs no update."""
    target, head = nnx.merge(graphs[0], state[0]), nnx.merge(graphs[1], state[1])
    tcache, dcache = cache
    out, count, lp, top_v, top_i, path, h, layers, tcache = verify_and_accept(
        target, tcache, tokens, parents, page_table, kv_lens, num_nodes, sb, flags, attn_impl,
        hidden_layers=head.cfg.feature_layers, max_depth=tree.steps + 1)
    count = jnp.where(num_nodes > 0, count, 0)  # a row with no nodes (stopped in verify_steps) emits nothing
    feats = jnp.take_along_axis(head.features(h, layers), path[:, :, None], axis=1)
    d_out, dcache = catch_up(head, target, dcache, feats, out, page_table, kv_lens, count, attn_impl)
    rows = jnp.arange(tokens.shape[0])
    last = count - 1
    tree_out = draft_tree(head, target, dcache, page_table, kv_lens + count, d_out[rows, last], out[rows, last], tree,
                          coupled(sb, flags, sb.step + count), attn_impl)
    chained = next_inputs(tree_out, tokens.shape[1], kv_lens, count, sb)
    return out, count, lp, top_v, top_i, tree_out, chained, path, (tcache, dcache)


def decode(graphs, attn_impl, state, cache, tokens, page_table, kv_lens, budget, stop_ids, num_steps, sb, flags):
    """Plain decode steps (programs.decode_loop) that keep the head in step, for the auto policy's
    plain decoding: each step also writes the head's K/V at the fed token's slot from its pair (the
    target's feature there, the token sampled after it). The head's output there is not computed
    (it needs the head's attention), so no tree is drafted: the next verify call verifies each root
    alone, then drafts from it. Outputs as programs._decode's, with both caches."""
    target, head = nnx.merge(graphs[0], state[0]), nnx.merge(graphs[1], state[1])

    def forward(cache, tok, kv, q):
        h, tcache, layers = target(tok, kv[:, None], cache[0], page_table, kv, q,
                                   hidden_layers=head.cfg.feature_layers, attn_impl=attn_impl)
        return target.logits(h), (tcache, cache[1]), head.features(h, layers)

    def keep(cache, feats, nxt, kv, q):  # (the queries and residual go unused: XLA drops them)
        return cache[0], write_pairs(head, target, cache[1], feats, nxt, page_table, kv, q)[2]
    return decode_loop(forward, keep, cache, tokens, kv_lens, budget, stop_ids, num_steps, sb, flags)


def widen(tree, width):
    """Drafted (tokens, parents) [B, n] in `width` columns, the last one repeated: a verify of
    num_nodes nodes ignores the columns past them."""
    take = jnp.minimum(jnp.arange(width), tree[0].shape[1] - 1)
    return tree[0][:, take], tree[1][:, take]


def next_inputs(tree_out, width, kv_lens, count, sb):
    """The next step's inputs, so that the host can launch it before reading this one (overlap):
    the next tree in this step's padded width, kv lengths and sampling steps advanced by the accepted counts."""
    return (*widen(tree_out, width), kv_lens + count, dataclasses.replace(sb, step=sb.step + count))


MAX_VERIFY_STEPS = 8  # a verify_steps call's most steps (its outputs' width); Scheduler(verify_steps=) runs fewer


def verify_steps(verify_step, tree: TreeShape, cuts: tuple, state, cache, tokens, parents, page_table, kv_lens,
                 num_nodes, budget, stop_ids, num_steps, next_nodes, sb, flags):
    """Up to num_steps (<= MAX_VERIFY_STEPS, a device scalar) verify steps in one call, each one
    drafting the next step's tree: the host launches and reads back once per call. verify_step:
    a device drafter's one-step function (`verify` here, or dflash_step.verify) with its graphs,
    tree and attention bound, taking (state, cache, ...) as `verify` does.

    The first step verifies the given trees (num_nodes [B]); the later ones their own drafts, of
    next_nodes nodes. Row b stops once it has emitted budget[b] tokens or emitted a token of
    stop_ids[b] (-1 padded); a stopped row verifies no nodes, so its caches stay put. cuts: the
    (depth, nodes) cuts of each verified tree whose emitted counts the auto policy compares shapes
    by (verify.cut_counts). Returns (emitted tokens [B, M, N], counts [B, M] (0 after a row
    stopped), logprobs [B, M, N], top-n values and ids [B, M, N, n] or None, the last step's drafted
    tree, the next call's (tokens, parents, kv lengths, sampling batch, budget) in this call's
    donated buffers, the cuts' counts [B, M, len(cuts)], caches)."""
    b, n, m, k = tokens.shape[0], tokens.shape[1], MAX_VERIFY_STEPS, flags.top_logprobs
    step = functools.partial(verify_step, state)
    width = min(n, tree.num_draft_tokens)
    tree0 = (jnp.zeros((b, tree.num_draft_tokens), jnp.int32), jnp.full((b, tree.num_draft_tokens), -1, jnp.int32))
    outs = dict(tokens=jnp.zeros((b, m, n), jnp.int32), counts=jnp.zeros((b, m), jnp.int32),
                lp=jnp.zeros((b, m, n), jnp.float32), cuts=jnp.zeros((b, m, len(cuts)), jnp.int32))
    if k:
        outs.update(top_v=jnp.zeros((b, m, n, k), jnp.float32), top_i=jnp.zeros((b, m, n, k), jnp.int32))

    def body(i, c):
        cache, tokens, parents, kv, sb, budget, nodes, outs, _ = c
        out, count, lp, top_v, top_i, tree_out, chained, path, cache = step(cache, tokens, parents, page_table, kv,
                                                                             nodes, sb, flags=flags)
        outs = dict(outs, tokens=outs["tokens"].at[:, i].set(out), counts=outs["counts"].at[:, i].set(count),
                    lp=outs["lp"].at[:, i].set(lp))
        if cuts:
            outs["cuts"] = outs["cuts"].at[:, i].set(cut_counts(parents, nodes, path, count, cuts))
        if k:
            outs.update(top_v=outs["top_v"].at[:, i].set(top_v), top_i=outs["top_i"].at[:, i].set(top_i))
        emitted = jnp.arange(n)[None] < count[:, None]
        stopped = jnp.any(emitted[:, :, None] & (out[:, :, None] == stop_ids[:, None, :]), axis=(1, 2))
        budget = budget - count
        alive = (nodes > 0) & (budget > 0) & ~stopped
        nodes = jnp.where(alive, jnp.minimum(next_nodes, width), 0)
        return (cache, chained[0], chained[1], chained[2], chained[3], budget, nodes, outs, tree_out)

    init = (cache, tokens, parents, kv_lens, sb, budget, jnp.where(budget > 0, num_nodes, 0), outs, tree0)
    cache, tokens, parents, kv_lens, sb, budget, nodes, outs, tree_out = steps_while_alive(
        jnp.minimum(num_steps, m), body, init, lambda c: c[6] > 0)
    # a row that stopped (a stop id too) has no budget left: a call chained on this one leaves it out at once
    return (outs["tokens"], outs["counts"], outs["lp"], outs.get("top_v"), outs.get("top_i"), tree_out,
            (tokens, parents, kv_lens, sb, jnp.where(nodes > 0, budget, 0)), outs["cuts"], cache)
