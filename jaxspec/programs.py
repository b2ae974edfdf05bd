"""The jitted device programs and the shapes they are compiled for.

`extend` feeds T new tokens per request (prefill chunks; decode is T = 1) and samples the token
after the last one. `verify_tree` runs a draft tree through the target, accepts the longest
matching root path, compacts the accepted K/V and returns the emitted tokens. The cache is
donated to both; neither syncs with the host.

With a device drafter (EAGLE heads) both programs come from the drafter's step module instead and
also keep the head in step and draft the next tree (drafters/eagle_step.py); the signatures are
the same, so the scheduler drives either.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import sampling
from jaxspec.kv_cache import move_slots
from jaxspec.pallas.accept import accept_tree
from jaxspec.pallas.tree_mask import tree_attention_mask

# Every compiled shape comes from these lists.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048)
TREE_BUCKETS = (2, 4, 8, 16, 32, 64)


def bucket(n: int, buckets) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def page_bucket(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


class Programs:
    def __init__(self, model, attn_impl: str = "auto", jit: bool = True, drafter=None):
        self.cfg = model.cfg
        self.attn_impl = attn_impl
        head = getattr(drafter, "head", None)
        if head is None:
            graphdef, self.state = nnx.split(model)
            extend = functools.partial(_extend, graphdef, attn_impl)
            verify = functools.partial(_verify_tree, graphdef, attn_impl)
        else:
            from jaxspec.drafters import eagle_step
            (g_target, s_target), (g_head, s_head) = nnx.split(model), nnx.split(head)
            self.state = (s_target, s_head)
            extend = functools.partial(eagle_step.extend, (g_target, g_head), drafter.tree, attn_impl)
            verify = functools.partial(eagle_step.verify, (g_target, g_head), drafter.tree, attn_impl)
        wrap = (lambda f, **kw: jax.jit(f, **kw)) if jit else (lambda f, **kw: f)
        self.extend = wrap(extend, static_argnames=("flags", "draft"), donate_argnames=("cache",))
        self.verify_tree = wrap(verify, static_argnames=("flags",), donate_argnames=("cache",))


def _extend(graphdef, attn_impl, state, cache, tokens, next_tokens, page_table, kv_lens, q_lens, sb, flags, draft):
    """tokens [B, T] at positions kv_len.. -> next token [B], its logprob [B], top-n, None (no
    draft tree), cache. next_tokens and draft serve device drafters only."""
    model = nnx.merge(graphdef, state)
    t = tokens.shape[1]
    positions = kv_lens[:, None] + jnp.arange(t)[None]
    h, cache, _ = model(tokens, positions, cache, page_table, kv_lens, q_lens, attn_impl=attn_impl)
    last = jnp.take_along_axis(h, jnp.maximum(q_lens - 1, 0)[:, None, None], axis=1)  # [B, 1, H]
    logits = model.logits(last)
    nxt = sampling.sample(logits, sb, flags)
    lp, top_v, top_i = sampling.logprobs_of(logits, nxt, flags.top_logprobs)
    squeeze = (lambda x: None if x is None else x[:, 0])
    return nxt[:, 0], lp[:, 0], squeeze(top_v), squeeze(top_i), None, cache


TREE_UNROLL: int | None = None  # None: tree_unroll decides (bench/eagle_probe.py sets it to compare)


def tree_unroll(cfg) -> int:
    """The layer loop's unroll in tree programs. Scanned, a layer's weights are a dynamic slice of
    the stacked weights, which XLA copies out before each gemm of more than one row (decode's
    one-row products read the slice in place): ~10 copy kernels a layer, 289 of a SmolLM2 tree
    step's 1024 at batch 1 (bench/results/eagle_probe-random-b1-*), where the host's launching of
    kernels bounds the step. Unrolled, the slices are static. The CPU keeps the scan: its cost
    there is compile time, not launches."""
    if TREE_UNROLL is not None:
        return TREE_UNROLL
    return cfg.num_layers if jax.default_backend() == "gpu" else 1


def verify_and_accept(model, cache, tokens, parents, page_table, kv_lens, num_nodes, sb, flags, attn_impl,
                      hidden_layers: tuple = ()):
    """The target over a draft tree, then accept. Shared by every tree-verifying step.

    tokens [B, N]: node 0 is the request's pending token (sampled last step, not yet cached),
    nodes 1.. the draft, in an order where parents come first; parents [B, N] (-1 for the root and
    padding). Returns (emitted tokens [B, N]: accepted drafts then the bonus token, their count
    [B], logprobs, top-n values, top-n ids, the accepted path [B, N], the target's final hidden
    [B, N, H] and hidden_layers' states, the cache with the accepted path's K/V moved into place).
    """
    mask, depth = tree_attention_mask(parents, num_nodes)
    h, cache, layers = model(tokens, kv_lens[:, None] + depth, cache, page_table, kv_lens, num_nodes, tree_mask=mask,
                             hidden_layers=hidden_layers, attn_impl=attn_impl, unroll=tree_unroll(model.cfg))
    logits = model.logits(h)  # [B, N, V]
    extra = None
    if flags.penalties:  # each node's penalty sees the draft tokens above it
        n = tokens.shape[1]
        anc = mask & ~jnp.eye(n, dtype=bool)[None] & (jnp.arange(n)[None, None] > 0)
        extra = jnp.where(anc, tokens[:, None, :], -1)
    target = sampling.sample(logits, sb, flags, extra, depth)  # the target's own token after each node
    path, num_accepted = accept_tree(tokens, parents, target, num_nodes, mask, depth)
    # Along the accepted path target[path[i]] == tokens[path[i + 1]], so the emitted tokens (the
    # accepted drafts, then the bonus) are simply the target's tokens at the path's nodes.
    count = num_accepted + 1
    out = jnp.where(jnp.arange(tokens.shape[1])[None] < count[:, None], jnp.take_along_axis(target, path, axis=1), 0)
    lp, top_v, top_i = sampling.logprobs_of(jnp.take_along_axis(logits, path[:, :, None], axis=1), out,
                                            flags.top_logprobs)
    cache = move_slots(cache, page_table, kv_lens, path, count)
    return out, count, lp, top_v, top_i, path, h, layers, cache


def _verify_tree(graphdef, attn_impl, state, cache, tokens, parents, page_table, kv_lens, num_nodes, sb, flags):
    """One speculative step over a draft tree (verify_and_accept); no next tree nor next step's
    inputs: the host drafts."""
    model = nnx.merge(graphdef, state)
    out, count, lp, top_v, top_i, _, _, _, cache = verify_and_accept(
        model, cache, tokens, parents, page_table, kv_lens, num_nodes, sb, flags, attn_impl)
    return out, count, lp, top_v, top_i, None, None, cache
