"""Training an EAGLE or EAGLE-3 head (`python -m jaxspec.train --kind eagle3`): the loss, the warm
start and the train / evaluate programs.

The target runs inside the training step (its features and its distribution over the draft
vocabulary are recomputed each step; nothing large is stored). The head is unrolled `ttt` steps
on its own outputs (EAGLE-3's training-time test): step j at position t reads the true token
t+1+j and the head's own hidden of step j-1, and learns the target's distribution for token
t+2+j. The head's parameters are float32 (the optimizer's master copy); the loss runs them in
`compute_dtype` (bf16 on GPU), with float32 logits, softmax and accumulation.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.drafters.eagle import DraftHead, HeadConfig
from jaxspec.models.llama import causal_mask, dense_forward
from jaxspec.sampling import NEG_INF
from jaxspec.train_data import draft_vocabulary, token_counts, vocabulary_coverage

DEFAULT_DRAFT_VOCAB = 4096  # a fresh EAGLE-3 head's, without --draft-vocab


def floats_as(tree, dtype):
    """The pytree with its floating-point leaves cast to dtype (integer ones, e.g. d2t, kept)."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def target_outputs(target, tokens, segments, positions, head_cfg: HeadConfig, hot):
    """Run the target over whole (packed) sequences: the head's input features [B, T, H] and the
    target's log-distribution over the draft vocabulary [B, T, Vd] (renormalised over it)."""
    cfg = target.cfg
    h, layers = dense_forward(target, tokens, head_cfg.feature_layers, segments, positions)
    w = target.embed[...].T if cfg.tie_word_embeddings else target.lm_head[...]
    logits = jnp.einsum("bth,hv->btv", h, w[:, hot], preferred_element_type=jnp.float32)
    feats = h if head_cfg.kind == "eagle" else jnp.concatenate(list(layers), axis=-1)
    return feats, h, jax.nn.log_softmax(logits)


def ttt_attention(q, ks, vs, segments=None):
    """Unrolled step j's queries [B, T, Hq, D]: causal over step 0's keys (the real prefix, within
    the query's own segment of a packed row) plus, at the same index only, steps 1..j's keys (the
    query's own drafted ancestors)."""
    b, t, hq, d = q.shape
    hkv = ks[0].shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scale = d ** -0.5
    s0 = jnp.einsum("bthgd,bshd->bhgts", qg, ks[0], preferred_element_type=jnp.float32) * scale
    mask = causal_mask(t, segments)
    s0 = jnp.where(mask if segments is None else mask[:, None, None], s0, NEG_INF)
    diag = [jnp.einsum("bthgd,bthd->bhgt", qg, k, preferred_element_type=jnp.float32)[..., None] * scale
            for k in ks[1:]]
    p = jax.nn.softmax(jnp.concatenate([s0] + diag, axis=-1), axis=-1).astype(vs[0].dtype)
    o = jnp.einsum("bhgts,bshd->bthgd", p[..., :t], vs[0], preferred_element_type=jnp.float32)
    for i, v in enumerate(vs[1:]):
        o = o + jnp.einsum("bhgt,bthd->bthgd", p[..., t + i], v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, hq, d).astype(q.dtype)


def shift(x, n):
    """x[:, i + n] at index i (zero past the end)."""
    return jnp.concatenate([x[:, n:], jnp.zeros_like(x[:, :n])], axis=1)


def unpacked(tokens, lengths, starts):
    """One sequence a row, right-padded: its (segments, positions, loss mask) for ttt_loss; the loss
    covers tokens at index >= starts (0: the whole text; the prompt's length: answers only)."""
    idx = jnp.arange(tokens.shape[1])[None]
    inside = idx < lengths[:, None]
    return inside.astype(jnp.int32), jnp.broadcast_to(idx, tokens.shape), inside & (idx >= starts[:, None])


def ttt_loss(head, target, feats, final, tokens, segments, positions, loss_mask, target_logp, ttt: int):
    """(mean over unroll steps, weighted 0.8^j, of the cross-entropy to the target's distribution,
    (per-step losses, per-step top-1 agreement, share of positions whose greedy chain is right
    through step j, right [ttt, B, T]: step j at index i drafts token i+2+j of i's own sequence
    and agrees with the target)). Rows hold one sequence or several packed (segments: 0 for
    padding, one id a sequence; positions restart at each); a draft counts where the token it
    predicts is in the position's own sequence and in loss_mask."""
    b, t = tokens.shape
    dtype = head.wqkv[...].dtype
    hidden = feats.astype(dtype) if head.cfg.kind == "eagle" else feats.astype(dtype) @ head.fc[...]
    same = lambda n: (shift(segments, n) == segments) & (segments > 0)  # index i + n in i's sequence
    ks, vs, total, accs, losses, rights = [], [], 0.0, [], [], []
    for j in range(ttt):
        q, k, v, res = head.qkv(target.embed_tokens(shift(tokens, 1 + j)).astype(dtype), hidden, positions + j)
        ks.append(k)
        vs.append(v)
        out = head.finish(ttt_attention(q, ks, vs, segments), res)
        logp = jax.nn.log_softmax(head.logits(target, out))
        want = shift(target_logp, 1 + j)
        in_seq = same(2 + j)  # the token this step drafts belongs to the position's sequence
        valid = (in_seq & shift(loss_mask, 2 + j)).astype(jnp.float32)
        denom = jnp.maximum(valid.sum(), 1.0)
        ce = -(jnp.exp(want) * logp).sum(-1)
        loss_j = (ce * valid).sum() / denom
        if head.cfg.kind == "eagle" and j == 0:  # EAGLE also regresses the next feature
            err = jnp.abs(out.astype(jnp.float32) - shift(final, 1).astype(jnp.float32))
            sl1 = jnp.where(err < 1, 0.5 * err ** 2, err - 0.5).mean(-1)
            loss_j = loss_j * 0.1 + (sl1 * valid).sum() / denom
        total = total + 0.8 ** j * loss_j
        losses.append(loss_j)
        right = (jnp.argmax(logp, -1) == jnp.argmax(want, -1)).astype(jnp.float32)
        rights.append(right * in_seq)
        accs.append((right * valid).sum() / denom)
        hidden = out
    # a chain verified greedily keeps draft j when drafts 1..j all match the target's argmax
    last = valid  # the positions whose whole chain lies inside the loss mask
    chain = jnp.cumprod(jnp.stack(rights), axis=0)
    through = (chain * last).sum((1, 2)) / jnp.maximum(last.sum(), 1.0)
    return total, (jnp.stack(losses), jnp.stack(accs), through, jnp.stack(rights))


def make_train_step(target, head_graph, head_rest, tx, hot, head_cfg: HeadConfig, ttt: int, compute_dtype):
    """(step, evaluate, target state): step(params, opt_state, t_state, tokens, segments, positions,
    loss_mask, i) on packed rows (train_data.pack_rows); evaluate(params, t_state, tokens, lengths,
    starts) on one sequence a row."""
    t_graph, t_state = nnx.split(target)

    def loss_fn(params, t_state, tokens, segments, positions, loss_mask):
        target = nnx.merge(t_graph, t_state)
        feats, final, target_logp = jax.lax.stop_gradient(
            target_outputs(target, tokens, segments, positions, head_cfg, hot))
        # float32 master weights, run in compute_dtype (the cast is inside the gradient)
        head = nnx.merge(head_graph, floats_as(params, compute_dtype), head_rest)
        return ttt_loss(head, target, feats, final, tokens, segments, positions, loss_mask, target_logp, ttt)

    @jax.jit
    def step(params, opt_state, t_state, tokens, segments, positions, loss_mask, _step):
        (loss, (_, accs, *_)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, t_state, tokens, segments,
                                                                                 positions, loss_mask)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, accs

    @jax.jit
    def evaluate(params, t_state, tokens, lengths, starts):
        return loss_fn(params, t_state, tokens, *unpacked(tokens, lengths, starts))

    return step, evaluate, t_state


def _copied(head: DraftHead, cfg, skip: tuple, seed: int = 0) -> DraftHead:
    """A float32 head of cfg (random from seed) holding head's weights and ids but those named in skip."""
    out = DraftHead(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    for name, var in vars(head).items():
        if isinstance(var, nnx.Variable) and name not in skip:
            getattr(out, name)[...] = jnp.asarray(var[...], jnp.float32 if isinstance(var, nnx.Param) else var[...].dtype)
    return out


def grow_draft_vocab(head: DraftHead, target, counts, size: int) -> DraftHead:
    """An EAGLE-3 head with its draft vocabulary grown to `size` target ids: its own ids and lm_head
    rows kept, the most frequent of the others (by counts) added. A new id's row is its target
    output row through the linear map that best takes the target's rows of the head's own ids to
    the head's trained rows (least squares): trained rows keep about half of the target's direction,
    and new rows taken as they are outscored the trained ones, so the grown head drafted mostly new
    ids. A token outside the draft vocabulary can never be drafted (what the shipped head's ids
    leave out of the target's own greedy text: bench/probes/draft_vocab.py)."""
    old = np.asarray(head.draft_to_target[...])
    if size <= len(old):
        raise ValueError(f"--draft-vocab {size}: the head's draft vocabulary has {len(old)} ids; it can only grow")
    ranked = np.argsort(-np.asarray(counts), kind="stable")
    hot = np.sort(np.concatenate([old, ranked[~np.isin(ranked, old)][:size - len(old)]])).astype(np.int32)
    grown = _copied(head, dataclasses.replace(head.cfg, draft_vocab_size=size), ("lm_head", "draft_to_target"))
    tw = np.asarray(target.embed[...].T if target.cfg.tie_word_embeddings else target.lm_head[...], np.float32)
    trained = np.asarray(head.lm_head[...], np.float32)
    fit, *_ = np.linalg.lstsq(tw[:, old].T, trained.T, rcond=None)  # [H, H]: target row -> trained row
    rows = (tw[:, hot].T @ fit).T
    rows[:, np.searchsorted(hot, old)] = trained
    grown.lm_head[...] = jnp.asarray(rows)
    grown.draft_to_target[...] = jnp.asarray(hot)
    return grown


def grow_intermediate(head: DraftHead, size: int, seed: int) -> DraftHead:
    """The head with its MLP widened to `size` units, computing what it computed: the new units'
    gate and up columns random, their down rows zero (they start to count once training moves those
    rows). Training a wider head from scratch drafted better at equal steps (train_ablation-layers-*),
    but the shipped head had many more steps behind it than a fresh one can be given."""
    F = head.cfg.intermediate_size
    if size <= F:
        raise ValueError(f"--intermediate-size {size}: the head's MLP has {F} units; it can only grow")
    grown = _copied(head, dataclasses.replace(head.cfg, intermediate_size=size), ("w_gate_up", "w_down"), seed)
    gate, up = np.split(np.asarray(head.w_gate_up[...], np.float32), 2, axis=1)
    new_gate, new_up = np.split(np.asarray(grown.w_gate_up[...]), 2, axis=1)
    grown.w_gate_up[...] = jnp.asarray(np.concatenate([gate, new_gate[:, F:], up, new_up[:, F:]], 1))
    down = np.zeros((size, head.cfg.hidden_size), np.float32)
    down[:F] = np.asarray(head.w_down[...], np.float32)
    grown.w_down[...] = jnp.asarray(down)
    return grown


def init_head(target, cfg: HeadConfig, hot, seed: int) -> DraftHead:
    """Random layer; the draft lm_head starts as the target's output rows of the draft vocabulary
    and the MLP as the target's last layer's (a warm start that shortens training a lot)."""
    head = DraftHead(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    tw = target.embed[...].T if target.cfg.tie_word_embeddings else target.lm_head[...]
    if cfg.kind == "eagle3":
        head.lm_head[...] = jnp.asarray(tw[:, hot], jnp.float32)
        head.draft_to_target[...] = jnp.asarray(hot, jnp.int32)
    if cfg.intermediate_size == target.cfg.intermediate_size:
        last = target.layers[-1]
        head.w_gate_up[...] = jnp.asarray(last.w_gate_up[...], jnp.float32)
        head.w_down[...] = jnp.asarray(last.w_down[...], jnp.float32)
    return head


def walk_accept_length(right, lengths, prompt_lengths) -> tuple[int, int]:
    """(tokens, steps) whose ratio is the accept length a top-1 chain of ttt drafts gets when verification walks each text as the
    engine does: from the first answer token on, a step keeps the drafts right in a row plus the
    target's own token, and the next step starts past them. right [ttt, B, T] as ttt_loss gives."""
    right = np.asarray(right) > 0
    ttt = right.shape[0]
    tokens = steps = 0
    for b in range(right.shape[1]):
        i = int(prompt_lengths[b]) - 1  # tokens through index i + 1 are known (the first answer token)
        while i + 2 < lengths[b]:
            k = 0
            while k < ttt and right[k, b, i]:
                k += 1
            i, tokens, steps = i + k + 1, tokens + k + 1, steps + 1
    return tokens, steps


def head_for_run(args, target, tokens, lengths):
    """(head, draft vocabulary's target ids, its share of the training tokens): --init-from's head
    (its draft vocabulary kept, not recounted) or a fresh one shaped by the flags."""
    vocab = target.cfg.vocab_size
    if args.init_from:
        from jaxspec.drafters.eagle import load_head
        head = load_head(args.init_from, target.cfg, target)
        if head.cfg.kind != args.kind:
            raise ValueError(f"--init-from {args.init_from} holds an {head.cfg.kind} head, not {args.kind}")
        counts = token_counts(tokens, lengths, vocab)
        if head.cfg.kind == "eagle3" and args.draft_vocab and args.draft_vocab != head.cfg.draft_vocab_size:
            head = grow_draft_vocab(head, target, counts, min(args.draft_vocab, vocab))
        if args.intermediate_size and args.intermediate_size != head.cfg.intermediate_size:
            head = grow_intermediate(head, args.intermediate_size, args.seed)
        hot = np.asarray(head.draft_to_target[...]) if head.cfg.kind == "eagle3" else np.arange(vocab)
        return head, hot, vocabulary_coverage(counts, hot)
    vd = min(args.draft_vocab or DEFAULT_DRAFT_VOCAB, vocab) if args.kind == "eagle3" else vocab
    hot, coverage = draft_vocabulary(tokens, lengths, vocab, vd)
    layers = tuple(int(x) for x in args.capture_layers.split(",")) if args.capture_layers else None
    cfg = HeadConfig.for_target(target.cfg, args.kind, draft_vocab_size=vd, intermediate_size=args.intermediate_size,
                                feature_layers=layers)
    return init_head(target, cfg, hot, args.seed), hot, coverage

