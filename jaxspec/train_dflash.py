"""Training a DFLASH drafter (`python -m jaxspec.train --drafter dflash`): the loss, the warm start
and the dense block forward that the engine's paged one is tested against.

Each training sequence gets `anchors` random block starts a. Block k is [token a, mask x (n-1)]
at positions a .. a+n-1; it sees the context (the drafter's projection of the target's features)
at positions < a and the whole of its own block, nothing of other blocks. Position i of the block
learns the target's distribution for token a+i (cross-entropy to the target's soft labels, as
the EAGLE heads learn), weighted exp(-(i-1)/gamma): the early positions decide acceptance.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.drafters.dflash import DFlashConfig, DFlashHead
from jaxspec.models.llama import dense_forward, rope_frequencies, rope_table
from jaxspec.sampling import NEG_INF
from jaxspec.train_data import token_counts
from jaxspec.train_eagle import floats_as


def block_forward(head, target, features, anchors, block_tokens):
    """Dense DFLASH forward of many blocks over one context. features [len(ids), B, T, H] (the
    target's layer outputs at positions 0..T-1); anchors [B, K]; block_tokens [B, K, n].
    Returns the drafter's output [B, K, n, H] (before its final norm)."""
    _, b, t, _ = features.shape
    k_blocks, n = block_tokens.shape[1:]
    cfg = head.cfg
    inv = rope_frequencies(cfg)
    ctx = head.context(features)
    rope_ctx = rope_table(jnp.broadcast_to(jnp.arange(t)[None], (b, t)), inv)
    rope_blk = rope_table((anchors[:, :, None] + jnp.arange(n)).reshape(b, k_blocks * n), inv)
    x = target.embed_tokens(block_tokens).reshape(b, k_blocks * n, -1).astype(ctx.dtype)
    # a block sees the context before its anchor and its own n positions, nothing of other blocks:
    # scores against the context and block-diagonal scores against the block, never a dense
    # [K*n, T + K*n] matrix (what lets training afford many anchors a sequence)
    ctx_ok = (jnp.arange(t)[None, None, :] < anchors[:, :, None])[:, None, None, :, None, :]  # [B,1,1,K,1,T]
    hkv, g, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    for layer in head.layers:
        kc, vc = layer.kv(ctx, rope_ctx)
        q, kb, vb = layer.qkv(x, rope_blk)
        qg = q.reshape(b, k_blocks, n, hkv, g, d)
        kb, vb = kb.reshape(b, k_blocks, n, hkv, d), vb.reshape(b, k_blocks, n, hkv, d)
        s_ctx = jnp.einsum("bknhgd,bshd->bhgkns", qg, kc, preferred_element_type=jnp.float32)
        s_blk = jnp.einsum("bknhgd,bkmhd->bhgknm", qg, kb, preferred_element_type=jnp.float32)
        s = jnp.concatenate([jnp.where(ctx_ok, s_ctx, NEG_INF), s_blk], axis=-1) * d ** -0.5
        p = jax.nn.softmax(s, axis=-1).astype(vc.dtype)
        o = (jnp.einsum("bhgkns,bshd->bknhgd", p[..., :t], vc, preferred_element_type=jnp.float32)
             + jnp.einsum("bhgknm,bkmhd->bknhgd", p[..., t:], vb, preferred_element_type=jnp.float32))
        x = layer.finish(x, o.reshape(b, k_blocks * n, cfg.num_heads, d).astype(x.dtype))
    return x.reshape(b, k_blocks, n, -1)


def dflash_loss(head, target, h, layers, tokens, lengths, starts, key, anchors: int):
    """(weighted loss, (per-position losses, top-1 agreement and share accepted through it, [n-1] each)).
    Blocks start where their first drafted token is at index >= starts (0, or the prompt's length)."""
    cfg = head.cfg
    b, t = tokens.shape
    n = cfg.block_size
    lo = jnp.maximum(starts - 1, 0)[:, None]
    a = jax.random.randint(key, (b, anchors), lo, jnp.maximum(lengths - 1, lo[:, 0] + 1)[:, None])  # a + 1 < length
    blocks = jnp.full((b, anchors, n), cfg.mask_token, jnp.int32)
    blocks = blocks.at[:, :, 0].set(jnp.take_along_axis(tokens, a, axis=1))
    out = block_forward(head, target, layers, a, blocks)[:, :, 1:]  # predicts tokens a+1 .. a+n-1
    src = a[:, :, None] + jnp.arange(n - 1)  # the target's prediction for token a+i sits at a+i-1
    valid = (src + 1 < lengths[:, None, None]).astype(jnp.float32)
    src = jnp.minimum(src, t - 1).reshape(b, -1)
    want = jax.nn.log_softmax(target.logits(jnp.take_along_axis(h, src[:, :, None], axis=1))).reshape(out.shape[:3] + (-1,))
    logp = jax.nn.log_softmax(head.logits(target, out))
    ce = -(jnp.exp(want) * logp).sum(-1)  # [B, K, n-1]
    denom = jnp.maximum(valid.sum((0, 1)), 1.0)
    per_pos = (ce * valid).sum((0, 1)) / denom
    right = (jnp.argmax(logp, -1) == jnp.argmax(want, -1)).astype(jnp.float32)
    acc = (right * valid).sum((0, 1)) / denom
    # greedy verification accepts draft j when drafts 1..j all match: the share of blocks that get
    # that far (1 + their sum is the accept length the drafter would reach on this text)
    through = (jnp.cumprod(right, axis=-1) * valid).sum((0, 1)) / denom
    gamma = max(1.0, (n - 1) / 2)
    w = jnp.exp(-jnp.arange(n - 1) / gamma)
    return (per_pos * w).sum() / w.sum(), (per_pos, acc, through)


def make_train_step(target, head_graph, head_rest, tx, cfg: DFlashConfig, anchors: int, seed: int, compute_dtype):
    """(step, evaluate, target state), as train_eagle.make_train_step's."""
    t_graph, t_state = nnx.split(target)

    def loss_fn(params, t_state, tokens, lengths, starts, step):
        target = nnx.merge(t_graph, t_state)
        h, layers = jax.lax.stop_gradient(dense_forward(target, tokens, cfg.target_layer_ids))
        head = nnx.merge(head_graph, floats_as(params, compute_dtype), head_rest)
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        return dflash_loss(head, target, h, layers, tokens, lengths, starts, key, anchors)

    @jax.jit
    def step_fn(params, opt_state, t_state, tokens, lengths, starts, step):
        (loss, (_, accs, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, t_state, tokens, lengths,
                                                                                 starts, step)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, accs

    @jax.jit
    def evaluate(params, t_state, tokens, lengths, starts):
        return loss_fn(params, t_state, tokens, lengths, starts, 2**31 - 1)  # fixed anchors, apart from training's

    return step_fn, evaluate, t_state


def mask_token_for(tokens, lengths, vocab_size: int, avoid=()) -> int:
    """The id the training data holds least often (never, in a real vocabulary), not one of
    `avoid` (EOS): its embedding marks the block's unknown positions without meaning much else."""
    counts = token_counts(tokens, lengths, vocab_size)
    counts[list(avoid)] = np.iinfo(np.int64).max
    return int(np.argmin(counts))


def init_drafter(target, cfg: DFlashConfig, seed: int) -> DFlashHead:
    """Random fc; each drafter layer starts as one of the target's last layers (norms, attention,
    MLP) and the final norm as the target's: a warm start, as the EAGLE heads get."""
    head = DFlashHead(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    tc = target.cfg
    if cfg.intermediate_size != tc.intermediate_size or cfg.num_heads != tc.num_heads or cfg.num_kv_heads != tc.num_kv_heads:
        return head
    f32 = lambda x: jnp.asarray(x[...], jnp.float32)
    hq = tc.num_heads * tc.head_dim
    for layer, src in zip(head.layers, list(target.layers)[-cfg.num_layers:]):
        layer.input_norm[...], layer.post_norm[...] = (jnp.ones_like(n[...]) for n in (layer.input_norm, layer.post_norm))
        # (the target's norm weights are in its wqkv's and w_gate_up's rows, which these take)
        layer.wq[...], layer.wkv[...] = f32(src.wqkv)[:, :hq], f32(src.wqkv)[:, hq:]
        layer.wo[...], layer.w_gate_up[...], layer.w_down[...] = f32(src.wo), f32(src.w_gate_up), f32(src.w_down)
        if tc.qk_norm:
            layer.q_norm[...], layer.k_norm[...] = f32(src.q_norm), f32(src.k_norm)
    head.norm[...] = f32(target.final_norm)
    return head


def drafter_for_run(args, target, tokens, lengths) -> DFlashHead:
    """The drafter a training run starts from: --init-from's (its shape, layers and mask token
    kept), or a fresh one shaped by the flags, its mask token the corpus's rarest id."""
    if args.init_from:
        from jaxspec.drafters.dflash import load_dflash
        return load_dflash(args.init_from, target.cfg, dtype=jnp.float32)
    from jaxspec.drafters.dflash import build_target_layer_ids
    mask = mask_token_for(tokens, lengths, target.cfg.vocab_size, target.cfg.eos_token_ids)
    ids = build_target_layer_ids(target.cfg.num_layers, args.feature_layers or args.draft_layers)
    cfg = DFlashConfig.for_target(target.cfg, args.draft_layers, args.block_size, mask, ids,
                                  intermediate_size=args.intermediate_size)
    return init_drafter(target, cfg, args.seed)
