"""The whole speculative generation loop as one pure, jittable function, for JAX programs that
generate inside themselves (RL rollouts, evaluation loops, distillation).

    fn, params, drafter_params = make_rollout(model, head, RolloutConfig("eagle3", max_new_tokens=256))
    out = jax.jit(fn)(params, drafter_params, prompts, lengths, seeds)   # vmap it, shard it

Prefill, then a `lax.while_loop` of the engine's own fused step. With a learned drafter (`eagle`,
`eagle3`, `dflash`) that is the drafter's `verify` program (drafters/eagle_step.py,
dflash_step.py): target verify, accept, K/V compaction, the drafter's catch-up on the accepted
tokens and the next draft, with the drafter's own cache; the first draft comes from the drafter's
`extend` over the prompt. `prompt_lookup` drafts in the graph from the row's own tokens (the
latest earlier occurrence of its last `ngram` tokens proposes what followed), `none` drafts
nothing; both verify with the engine's `verify_and_accept`. Sampling keys by output position as
the engine does, so seeded rows give the Generator's tokens, speculative or not.

Weights are arguments (new weights, e.g. after an RL update, reuse the compiled program); the
configuration is static; prompts, lengths, seeds and the per-row sampling values are traced.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import sampling
from jaxspec.drafters.eagle_step import TreeShape, nodes_that_fit, widen
from jaxspec.kv_cache import KVCache
from jaxspec.programs import TREE_BUCKETS, bucket
from jaxspec.pallas.tree_mask import chain_parents
from jaxspec.verify import verify_and_accept

ALGORITHMS = ("none", "prompt_lookup", "eagle", "eagle3", "dflash")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    algorithm: str = "none"
    max_new_tokens: int = 64
    num_draft_tokens: int = 8  # nodes verified a step, the root included (prompt_lookup: drafts + 1; dflash: block)
    num_steps: int = 3  # tree depth (dflash with topk > 1: its block is num_steps + 1 tokens)
    topk: int | None = None  # branching: default 4, dflash 1 (a chain; > 1 a tree from the block's distributions)
    ngram: int = 2  # prompt_lookup: tokens matched
    sample: bool = False  # compile the sampler (rows at temperature 0 stay greedy); False: greedy only
    page_size: int = 16
    attn_impl: str = "auto"
    # A learned drafter's tree shrinks to fit max_verify_tokens nodes a step over the whole batch,
    # and where it would verify fewer than min_nodes (a smaller tree of the drafter's own is kept
    # whole; DFLASH's chain is not cut) the rollout decodes plainly: the engine's rule
    # (scheduler.core.tree_size). At batch 64 the 6:4:24 tree ran at 0.68x plain greedy and 0.37x at
    # temperature 1 (rollout-NVIDIA-H100-80GB-HBM3.json, 5c18bf9). None: the tree as given.
    max_verify_tokens: int | None = 128
    min_nodes: int = 16
    # A sampling rollout (sample=True) verifies within this smaller budget: at temperature 1 the
    # shipped EAGLE-3 head's drafts were accepted less (2.0 tokens a step against 3.0 greedy) and
    # its 6:4:24 tree ran at 1.31x plain at batch 1 but 0.70x at batch 8, where 128 tokens left a
    # 16-node tree (rollout-NVIDIA-H100-80GB-HBM3.json, ab1ce96). With 32, batch 1 keeps its 24
    # nodes, batch 2 verifies 16 and from batch 4 (8 nodes) it decodes plainly. None: as greedy.
    sampled_max_verify_tokens: int | None = 32

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"rollout algorithm {self.algorithm!r}: choose one of {ALGORITHMS}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")

    def tree(self, batch: int) -> TreeShape | None:
        """The tree a step verifies at this batch size, or None where the batch decodes plainly."""
        n = self.num_draft_tokens
        chain = self.algorithm == "dflash" and (self.topk or 1) == 1
        budget = self.max_verify_tokens
        if budget is not None and self.sample and self.sampled_max_verify_tokens is not None:
            budget = min(budget, self.sampled_max_verify_tokens)
        if budget is not None:
            n = nodes_that_fit(n, budget, batch, self.min_nodes)
            if n == 1 or (chain and n < self.num_draft_tokens):
                return None
        if chain:
            return TreeShape(n - 1, 1, n)
        return TreeShape(self.num_steps, self.topk or 4, n)


class RolloutOutput(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens], 0 past each row's length
    logprobs: jax.Array  # [B, max_new_tokens]: each token's log-probability under the target (raw logits)
    lengths: jax.Array  # [B]
    stopped: jax.Array  # [B] bool: ended on a stop id (else at max_new_tokens)
    steps: jax.Array  # [B] target passes after the prefill: lengths / steps is the mean accept length


def make_rollout(model, head=None, config: RolloutConfig = RolloutConfig(), mesh=None):
    """(fn, params, drafter_params): fn(params, drafter_params, prompts, lengths, seeds, ...) is
    `rollout` with the modules' structure bound; jit it (or vmap / shard it) as it is. mesh: the
    tensor-parallel mesh a model laid out by `load(..., mesh=)` is sharded over (a 'tp' axis, and
    any others, e.g. 'data' for the rows): the attention kernels then run per shard."""
    learned = config.algorithm in ("eagle", "eagle3", "dflash")
    if learned and head is None:
        raise ValueError(f"rollout algorithm {config.algorithm} needs its drafter module")
    graphs, params = nnx.split(model)
    if learned:
        head_graph, drafter_params = nnx.split(head)
        graphs = (graphs, head_graph)
    else:
        drafter_params = None
    fn = functools.partial(rollout, graphs, config=config)
    if mesh is not None:
        plain = fn

        @functools.wraps(plain)
        def fn(*args, **kwargs):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # attention.py reads it while tracing
                return plain(*args, **kwargs)
    return fn, params, drafter_params


def rollout(graphs, params, drafter_params, prompts, lengths, seeds, temperature=None, top_p=None, top_k=None,
            stop_ids=None, *, config: RolloutConfig) -> RolloutOutput:
    """prompts [B, P] right-padded, lengths [B], seeds [B]; per-row temperature / top_p / top_k [B]
    (with config.sample; leaving top_p and top_k out skips the vocabulary sort they need) and
    stop_ids [B, S] (-1 padded; default the model's EOS ids)."""
    learned = config.algorithm in ("eagle", "eagle3", "dflash")
    target = nnx.merge(graphs[0] if learned else graphs, params)
    b, p = prompts.shape
    row = lambda x, fill, dtype: jnp.full((b,), fill, dtype) if x is None else jnp.asarray(x, dtype)
    sb = sampling.SamplingBatch(
        temperature=row(temperature, 1.0 if config.sample else 0.0, jnp.float32), top_k=row(top_k, 0, jnp.int32),
        top_p=row(top_p, 1.0, jnp.float32), min_p=jnp.zeros(b, jnp.float32), seed=seeds.astype(jnp.uint32),
        step=jnp.zeros(b, jnp.int32), repetition_penalty=jnp.ones(b, jnp.float32),
        frequency_penalty=jnp.zeros(b, jnp.float32), presence_penalty=jnp.zeros(b, jnp.float32),
        history=jnp.full((b, 1), -1, jnp.int32), num_prompt=jnp.zeros(b, jnp.int32))
    # the top-k / top-p filter sorts every verified node's logits over the vocabulary: compiled in
    # only when the caller passes those rows (None is top_k 0, top_p 1: nothing to filter)
    flags = sampling.SamplerFlags(sample=config.sample,
                                  filter=config.sample and (top_p is not None or top_k is not None))
    if stop_ids is None:
        eos = jnp.asarray(target.cfg.eos_token_ids or (-1,), jnp.int32)
        stop_ids = jnp.broadcast_to(eos, (b, eos.shape[0]))
    tree = config.tree(b) if learned else None
    if tree is not None:
        return _learned_loop(graphs, target, params, drafter_params, prompts, lengths, sb, flags, stop_ids, config, tree)
    return _lookup_loop(target, prompts, lengths, sb, flags, stop_ids, config)  # a learned drafter's: plain


def _paged(b, tokens_per_row, page_size):
    """A page table giving each row its own run of pages (page 0 is the kernels' drop page)."""
    pages = -(-tokens_per_row // page_size)
    return b * pages + 1, 1 + jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)


def _emit(carry, emitted, lp, count, stop_ids, max_new):
    """Append each row's `count` tokens, cut at its first stop id and at max_new tokens."""
    out, lps, n_out, done = carry
    i = jnp.arange(emitted.shape[1])[None]
    hit = jnp.any(emitted[:, :, None] == stop_ids[:, None, :], axis=2) & (i < count[:, None])
    stop_at = jnp.argmax(hit, axis=1)
    stopped = hit.any(axis=1) & (stop_at + 1 <= max_new - n_out)
    count = jnp.where(hit.any(axis=1), jnp.minimum(count, stop_at + 1), count)
    count = jnp.where(done, 0, jnp.minimum(count, max_new - n_out))
    keep = i < count[:, None]
    rows, at = jnp.arange(out.shape[0])[:, None], n_out[:, None] + i  # out has room for a step past max_new
    out = out.at[rows, at].set(jnp.where(keep, emitted, out[rows, at]))
    lps = lps.at[rows, at].set(jnp.where(keep, lp, lps[rows, at]))
    n_out = n_out + count
    return (out, lps, n_out, done | (n_out >= max_new) | (stopped & ~done)), stopped & ~done, count


def _learned_loop(graphs, target, params, drafter_params, prompts, lengths, sb, flags, stop_ids, config, tree):
    from jaxspec.drafters.dflash import DFlashDrafter
    from jaxspec.drafters.eagle import EagleDrafter
    head = nnx.merge(graphs[1], drafter_params)
    drafter = (DFlashDrafter if config.algorithm == "dflash" else EagleDrafter)(head, tree)
    fns = drafter.step_functions(graphs, config.attn_impl)
    state = (params, drafter_params)
    b, p = prompts.shape
    n, max_new = tree.num_draft_tokens, config.max_new_tokens
    # verified in the engine's bucketed width (nodes past n ignored): at 24 nodes in 24 columns the
    # Hopper verify kernel padded each layer's queries to 32 (30 more kernels a SmolLM2 step)
    width = bucket(n, TREE_BUCKETS) if n <= TREE_BUCKETS[-1] else n
    cfg = target.cfg
    num_pages, page_table = _paged(b, p + max_new + width + drafter.draft_slots + 1, config.page_size)
    dtype = target.embed[...].dtype
    cache = (KVCache.create(cfg.num_layers, num_pages, config.page_size, cfg.num_kv_heads, cfg.head_dim, dtype),
             drafter.create_cache(num_pages, config.page_size, dtype))
    zeros = jnp.zeros(b, jnp.int32)
    first, lp0, _, _, (tokens, parents), _, cache = fns["extend"](state, cache, prompts, jnp.full(b, -1, jnp.int32),
                                                                  page_table, zeros, lengths, sb, flags=flags)
    tokens, parents = widen((tokens, parents), width)
    room = max_new + width
    carry, stopped, _ = _emit((jnp.zeros((b, room), jnp.int32), jnp.zeros((b, room), jnp.float32), zeros, jnp.zeros(b, bool)),
                              first[:, None], lp0[:, None], jnp.ones(b, jnp.int32), stop_ids, max_new)
    sb = dataclasses.replace(sb, step=sb.step + 1)

    def body(c):
        cache, tokens, parents, kv, sb, carry, stopped, steps = c
        nodes = jnp.where(carry[3], 0, n)
        out, count, lp, _, _, _, (tokens, parents, kv, sb), _, cache = fns["verify"](
            state, cache, tokens, parents, page_table, kv, nodes, sb, flags=flags)
        steps = steps + (nodes > 0)
        carry, stop_now, _ = _emit(carry, out, lp, count, stop_ids, max_new)
        return cache, tokens, parents, kv, sb, carry, stopped | stop_now, steps

    init = (cache, tokens, parents, lengths, sb, carry, stopped, zeros)
    *_, carry, stopped, steps = jax.lax.while_loop(lambda c: ~jnp.all(c[5][3]), body, init)
    out, lps, n_out, _ = carry
    return RolloutOutput(out[:, :max_new], lps[:, :max_new], n_out, stopped, steps)


def lookup_draft(buf, length, ngram: int, num_draft: int):
    """buf [B, L] tokens, length [B] -> draft [B, num_draft] continuing the latest earlier match
    of the last `ngram` tokens (zeros when there is none; the verify rejects them)."""
    b, l = buf.shape
    j = jnp.arange(l)
    tail = jnp.stack([jnp.take_along_axis(buf, (length - ngram + i)[:, None], axis=1)[:, 0] for i in range(ngram)], 1)
    match = jnp.ones((b, l), bool)
    for i in range(ngram):
        shifted = jnp.roll(buf, -i, axis=1)
        match &= shifted == tail[:, i:i + 1]
    match &= (j[None] + ngram < length[:, None]) & (length[:, None] >= ngram)
    start = jnp.max(jnp.where(match, j[None] + ngram, -1), axis=1)
    idx = jnp.clip(start[:, None] + jnp.arange(num_draft)[None], 0, l - 1)
    draft = jnp.take_along_axis(buf, idx, axis=1)
    return jnp.where(start[:, None] >= 0, draft, 0)


def _lookup_loop(target, prompts, lengths, sb, flags, stop_ids, config):
    """none / prompt_lookup: the prompt but its last token prefilled; each step verifies [the
    pending token, its drafts] as a chain."""
    b, p = prompts.shape
    k = config.num_draft_tokens if config.algorithm == "prompt_lookup" else 1
    max_new, cfg = config.max_new_tokens, target.cfg
    total = p + max_new + k
    num_pages, page_table = _paged(b, total, config.page_size)
    cache = KVCache.create(cfg.num_layers, num_pages, config.page_size, cfg.num_kv_heads, cfg.head_dim,
                           target.embed[...].dtype)
    zeros = jnp.zeros(b, jnp.int32)
    _, cache, _ = target(prompts, jnp.broadcast_to(jnp.arange(p)[None], (b, p)), cache, page_table, zeros,
                         lengths - 1, attn_impl=config.attn_impl)
    buf = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompts)
    parents = chain_parents(b, k)

    def body(c):
        cache, buf, sb, carry, stopped, steps = c
        length = lengths + carry[2]  # tokens known; the last one has no K/V yet
        root = jnp.take_along_axis(buf, (length - 1)[:, None], axis=1)
        tokens = jnp.concatenate([root, lookup_draft(buf, length, config.ngram, k - 1)], axis=1) if k > 1 else root
        nodes = jnp.where(carry[3], 0, k)
        out, count, lp, _, _, _, _, _, cache = verify_and_accept(target, cache, tokens, parents, page_table, length - 1,
                                                                 nodes, sb, flags, config.attn_impl)
        steps = steps + (nodes > 0)
        n_before = carry[2]
        carry, stop_now, count = _emit(carry, out, lp, count, stop_ids, max_new)
        rows, i = jnp.arange(b)[:, None], jnp.arange(k)[None]
        at = lengths[:, None] + n_before[:, None] + i
        buf = buf.at[rows, at].set(jnp.where(i < count[:, None], out, buf[rows, at]))
        sb = dataclasses.replace(sb, step=sb.step + count)
        return cache, buf, sb, carry, stopped | stop_now, steps

    carry = (jnp.zeros((b, max_new + k), jnp.int32), jnp.zeros((b, max_new + k), jnp.float32), zeros,
             jnp.zeros(b, bool))
    init = (cache, buf, sb, carry, jnp.zeros(b, bool), zeros)
    *_, carry, stopped, steps = jax.lax.while_loop(lambda c: ~jnp.all(c[3][3]), body, init)
    out, lps, n_out, _ = carry
    return RolloutOutput(out[:, :max_new], lps[:, :max_new], n_out, stopped, steps)


def jit_rollout(model: nnx.Module, head=None, **config) -> tuple:
    """Convenience: (jitted fn(params, drafter_params, prompts, lengths, seeds, ...), params,
    drafter_params), compiled as the engine's programs are: on a GPU the loop runs as CUDA graph
    conditional nodes (compile_options.loop_options; pass them to your own jax.jit likewise)."""
    from jaxspec.compile_options import loop_options
    fn, params, drafter_params = make_rollout(model, head, RolloutConfig(**config))
    return jax.jit(fn, compiler_options=loop_options()), params, drafter_params
