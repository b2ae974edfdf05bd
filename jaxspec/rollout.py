"""A whole speculative generation loop as one pure, jittable function (for RL rollouts and other
JAX programs): prefill, then `lax.while_loop` over fused draft-verify-accept steps, all on device.

The drafter is in-graph prompt lookup (an n-gram drafter over the request's own tokens): the
latest earlier occurrence of the last `ngram` tokens proposes the `num_draft` tokens that followed
it, verified as a chain. Configuration is static; prompts, lengths and seeds are traced, so the
function can be jitted once and vmapped or sharded by the caller.

    out, n = jax.jit(rollout, static_argnames=("graphdef", "max_new_tokens", ...))(graphdef, state, ...)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import sampling
from jaxspec.kv_cache import KVCache
from jaxspec.pallas.accept import accept_tree
from jaxspec.pallas.tree_mask import chain_parents


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


def rollout(graphdef: nnx.GraphDef, state: nnx.State, prompts: jax.Array, prompt_lens: jax.Array, seeds: jax.Array,
            *, max_new_tokens: int, num_draft: int = 4,
            ngram: int = 2, temperature: float = 0.0, eos_id: int = -1, page_size: int = 16):
    """prompts [B, P] (right-padded), prompt_lens [B], seeds [B] -> (tokens [B, max_new_tokens], counts [B]).

    Greedy when temperature == 0, else sampling (lossless; keys by output position, as the engine).
    """
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    b, p = prompts.shape
    k = num_draft + 1
    total = p + max_new_tokens + k
    pages = -(-total // page_size)
    cache = KVCache.create(cfg.num_layers, b * pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim,
                           model.embed[...].dtype)
    page_table = 1 + jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    sb = sampling.SamplingBatch(
        temperature=jnp.full((b,), temperature, jnp.float32), top_k=jnp.zeros(b, jnp.int32),
        top_p=jnp.ones(b, jnp.float32), min_p=jnp.zeros(b, jnp.float32), seed=seeds.astype(jnp.uint32),
        step=jnp.zeros(b, jnp.int32), repetition_penalty=jnp.ones(b, jnp.float32),
        frequency_penalty=jnp.zeros(b, jnp.float32), presence_penalty=jnp.zeros(b, jnp.float32),
        history=jnp.full((b, 1), -1, jnp.int32), num_prompt=jnp.zeros(b, jnp.int32))
    flags = sampling.SamplerFlags(sample=temperature > 0)

    # prefill all but the last prompt token; the loop's first step feeds that one as its root
    zeros = jnp.zeros(b, jnp.int32)
    _, cache, _ = model(prompts, jnp.arange(p)[None].repeat(b, 0), cache, page_table, zeros, prompt_lens - 1)
    buf = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompts)
    out = jnp.zeros((b, max_new_tokens + k), jnp.int32)
    parents = chain_parents(b, k)

    def cond(c):
        _, _, _, n_out, done = c
        return ~jnp.all(done)

    def body(c):
        cache, buf, out, n_out, done = c
        length = prompt_lens + n_out  # tokens known; the last has no K/V yet
        root = jnp.take_along_axis(buf, (length - 1)[:, None], axis=1)
        tokens = jnp.concatenate([root, lookup_draft(buf, length, ngram, num_draft)], axis=1)
        kv = length - 1
        q_len = jnp.where(done, 0, k)
        h, cache, _ = model(tokens, kv[:, None] + jnp.arange(k)[None], cache, page_table, kv, q_len)
        logits = model.logits(h)
        sb_now = sampling.SamplingBatch(**{**sb.__dict__, "step": n_out})
        target = sampling.sample(logits, sb_now, flags, depth=jnp.broadcast_to(jnp.arange(k), (b, k)))
        path, accepted = accept_tree(tokens, parents, target, jnp.full((b,), k, jnp.int32))
        emitted = jnp.take_along_axis(target, path, axis=1)  # chain: path[i] = i for i <= accepted
        count = accepted + 1
        i = jnp.arange(k)[None]
        is_eos = (emitted == eos_id) & (i < count[:, None])
        first_eos = jnp.argmax(is_eos, axis=1)
        count = jnp.where(is_eos.any(axis=1), first_eos + 1, count)
        count = jnp.where(done, 0, jnp.minimum(count, max_new_tokens - n_out))
        keep = i < count[:, None]
        rows = jnp.arange(b)[:, None]
        out = out.at[rows, n_out[:, None] + i].set(jnp.where(keep, emitted, out[rows, n_out[:, None] + i]))
        buf = buf.at[rows, length[:, None] + i].set(jnp.where(keep, emitted, buf[rows, length[:, None] + i]))
        n_out = n_out + count
        done = done | (n_out >= max_new_tokens) | is_eos.any(axis=1)
        return cache, buf, out, n_out, done

    init = (cache, buf, out, zeros, jnp.zeros(b, bool))
    _, _, out, n_out, _ = jax.lax.while_loop(cond, body, init)
    return out[:, :max_new_tokens], n_out


def jit_rollout(model: nnx.Module, **static) -> tuple:
    """Convenience: (state, prompts, prompt_lens, seeds) -> (tokens, counts), jitted."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(functools.partial(rollout, graphdef, **static))
    return fn, state
