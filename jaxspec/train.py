"""Train an EAGLE or EAGLE-3 head, or a DFLASH drafter, for a target model on data the target
writes itself.

    python -m jaxspec.train --model smollm2-135m --kind eagle3 --run runs/smollm2-eagle3 \\
        --export jaxspec/drafters/weights/smollm2-135m-eagle3

1. data (once per run directory): the target invents user prompts (sampled after the chat
   template's user header, seeded with generic openers) and answers them itself, greedily and
   partly sampled, as EAGLE regenerates ShareGPT with its target (jaxspec/train_data.py). No
   benchmark prompt is used. `--data-only` stops after writing data.npz.
2. training: the target runs in the training step (features and its distribution over the draft
   vocabulary are recomputed each step, nothing large is stored); the head is unrolled `--ttt`
   steps on its own outputs (EAGLE-3's training-time test) and learns the target's distribution
   at every step. optax AdamW; orbax checkpoints every `--save-every` steps and when
   `--max-minutes` runs out, so a run stops and resumes cleanly. `--drafter dflash` trains a
   DFLASH block drafter instead (its loss: train_dflash.py), on the same data.
3. export: safetensors in SGLang's EAGLE-3 (or SafeAILab's EAGLE) layout, loss/accuracy curves as
   PNG, and a training card (card.json).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.drafters.eagle import DraftHead, HeadConfig, export_head
from jaxspec.kv_cache import KVCache
from jaxspec.sampling import NEG_INF
from jaxspec.train_data import build_data, draft_vocabulary, pack

# -- 2. the training step --------------------------------------------------------------------------------
def target_outputs(target, tokens, lengths, head_cfg: HeadConfig, hot):
    """Run the target over whole sequences: the head's input features [B, T, H] and the target's
    log-distribution over the draft vocabulary [B, T, Vd] (renormalised over it)."""
    cfg = target.cfg
    b, t = tokens.shape
    cache = KVCache.create(cfg.num_layers, b + 1, t, cfg.num_kv_heads, cfg.head_dim, target.embed[...].dtype)
    pt = (1 + jnp.arange(b, dtype=jnp.int32))[:, None]
    zeros = jnp.zeros(b, jnp.int32)
    h, _, layers = target(tokens, jnp.broadcast_to(jnp.arange(t)[None], (b, t)), cache, pt, zeros, lengths,
                          hidden_layers=head_cfg.feature_layers, attn_impl="ref")
    w = target.embed[...].T if cfg.tie_word_embeddings else target.lm_head[...]
    logits = jnp.einsum("bth,hv->btv", h, w[:, hot], preferred_element_type=jnp.float32)
    feats = h if head_cfg.kind == "eagle" else jnp.concatenate(list(layers), axis=-1)
    return feats.astype(jnp.float32), h.astype(jnp.float32), jax.nn.log_softmax(logits)


def ttt_attention(q, ks, vs):
    """Unrolled step j's queries [B, T, Hq, D]: causal over step 0's keys (the real prefix) plus,
    at the same index only, steps 1..j's keys (the query's own drafted ancestors)."""
    b, t, hq, d = q.shape
    hkv = ks[0].shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scale = d ** -0.5
    s0 = jnp.einsum("bthgd,bshd->bhgts", qg, ks[0], preferred_element_type=jnp.float32) * scale
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    s0 = jnp.where(causal, s0, NEG_INF)
    diag = [jnp.einsum("bthgd,bthd->bhgt", qg, k, preferred_element_type=jnp.float32)[..., None] * scale
            for k in ks[1:]]
    p = jax.nn.softmax(jnp.concatenate([s0] + diag, axis=-1), axis=-1)
    o = jnp.einsum("bhgts,bshd->bthgd", p[..., :t], vs[0])
    for i, v in enumerate(vs[1:]):
        o = o + jnp.einsum("bhgt,bthd->bthgd", p[..., t + i], v)
    return o.reshape(b, t, hq, d)


def shift(x, n):
    """x[:, i + n] at index i (zero past the end)."""
    return jnp.concatenate([x[:, n:], jnp.zeros_like(x[:, :n])], axis=1)


def ttt_loss(head, target, feats, final, tokens, lengths, target_logp, ttt: int):
    """Mean over unroll steps (weighted 0.8^j) of the cross-entropy to the target's distribution."""
    b, t = tokens.shape
    idx = jnp.arange(t)[None]
    hidden = feats if head.cfg.kind == "eagle" else feats @ head.fc[...]
    ks, vs, total, accs, losses = [], [], 0.0, [], []
    for j in range(ttt):
        q, k, v, res = head.qkv(target.embed_tokens(shift(tokens, 1 + j)).astype(jnp.float32), hidden,
                                jnp.broadcast_to(idx + j, (b, t)))
        ks.append(k)
        vs.append(v)
        out = head.finish(ttt_attention(q, ks, vs), res)
        logp = jax.nn.log_softmax(head.logits(target, out))
        want = shift(target_logp, 1 + j)
        valid = (idx + 1 + j < lengths[:, None]).astype(jnp.float32)
        denom = jnp.maximum(valid.sum(), 1.0)
        ce = -(jnp.exp(want) * logp).sum(-1)
        loss_j = (ce * valid).sum() / denom
        if head.cfg.kind == "eagle" and j == 0:  # EAGLE also regresses the next feature
            err = jnp.abs(out - shift(final, 1))
            sl1 = jnp.where(err < 1, 0.5 * err ** 2, err - 0.5).mean(-1)
            loss_j = loss_j * 0.1 + (sl1 * valid).sum() / denom
        total = total + 0.8 ** j * loss_j
        losses.append(loss_j)
        accs.append(((jnp.argmax(logp, -1) == jnp.argmax(want, -1)) * valid).sum() / denom)
        hidden = out
    return total, (jnp.stack(losses), jnp.stack(accs))


def make_train_step(target, head_graph, head_rest, tx, hot, head_cfg: HeadConfig, ttt: int):
    t_graph, t_state = nnx.split(target)

    def loss_fn(params, t_state, tokens, lengths):
        target = nnx.merge(t_graph, t_state)
        feats, final, target_logp = jax.lax.stop_gradient(target_outputs(target, tokens, lengths, head_cfg, hot))
        head = nnx.merge(head_graph, params, head_rest)
        return ttt_loss(head, target, feats, final, tokens, lengths, target_logp, ttt)

    @jax.jit
    def step(params, opt_state, t_state, tokens, lengths, _step):
        (loss, (losses, accs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, t_state, tokens, lengths)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, accs

    @jax.jit
    def evaluate(params, t_state, tokens, lengths):
        return loss_fn(params, t_state, tokens, lengths)

    return step, evaluate, t_state


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
        gate, up = jnp.split(jnp.asarray(last.w_gate_up[...], jnp.float32), 2, axis=-1)
        head.w_gate[...], head.w_up[...] = gate, up
        head.w_down[...] = jnp.asarray(last.w_down[...], jnp.float32)
    return head


# -- 3. curves ------------------------------------------------------------------------------------------
def plot_curves(metrics_path: str, out_dir: str) -> list[str]:
    """loss.png and accuracy.png from metrics.jsonl; returns the files written (none without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: curves not drawn (pip install matplotlib)")
        return []
    rows = [json.loads(l) for l in open(metrics_path)]
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    written = []
    for name, key, ylabel in [("loss.png", "loss", "loss (weighted over unroll steps)"),
                              ("accuracy.png", "acc", "top-1 agreement with the target")]:
        fig, ax = plt.subplots(figsize=(6, 4))
        if key == "loss":
            ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
            if val:
                ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="held-out")
        else:
            for j in range(len(train[0]["acc"])):
                src = val or train
                ax.plot([r["step"] for r in src], [r["acc"][j] for r in src], label=f"draft token {j + 1}")
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if val and "accepted_through" in val[0]:  # DFLASH: the accept length greedy verify would reach
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["step"] for r in val], [1 + sum(r["accepted_through"]) for r in val], "o-")
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out accept length (greedy, one block)")
        fig.tight_layout()
        path = os.path.join(out_dir, "accept_length.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


# -- driver -------------------------------------------------------------------------------------------------
def held_out_accept(eval_fn, params, t_state, tokens, lengths, batch: int) -> dict:
    """A DFLASH drafter on all held-out sequences: top-1 agreement and the share of blocks accepted
    through each block position (greedy), and the accept length those give (1 + their sum)."""
    acc, through = [], []
    for i in range(0, max(len(tokens) - batch + 1, 1), batch):
        _, (_, a, t) = eval_fn(params, t_state, tokens[i:i + batch], lengths[i:i + batch])
        acc.append(np.asarray(a))
        through.append(np.asarray(t))
    through = np.mean(through, 0)
    return dict(held_out_sequences=int(min(len(tokens), len(acc) * batch)),
                held_out_acc=[round(float(a), 4) for a in np.mean(acc, 0)],
                held_out_accepted_through=[round(float(a), 4) for a in through],
                held_out_accept_length=round(1 + float(through.sum()), 3))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jaxspec.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kind", "--drafter", dest="kind", choices=["eagle3", "eagle", "dflash"], default="eagle3")
    ap.add_argument("--run", required=True, help="run directory: data, checkpoints, metrics, curves")
    ap.add_argument("--export", help="write the trained head here when training completes")
    ap.add_argument("--num-prompts", type=int, default=4000)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--sampled-fraction", type=float, default=0.25, help="answers sampled at T=0.7 instead of greedy")
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ttt", type=int, default=4, help="unrolled draft steps in the loss")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-fraction", type=float, default=0.02)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--max-minutes", type=float, default=None, help="checkpoint and stop after this long")
    ap.add_argument("--export-dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-only", action="store_true", help="generate the run's data.npz and stop")
    ap.add_argument("--data", default=None, help="train on this data.npz (e.g. a corpus in data/) rather than the run's")
    ap.add_argument("--init-from", default=None,
                    help="start from this exported head or DFLASH drafter, not a fresh one (an EAGLE-3 head's draft "
                         "vocabulary, a DFLASH drafter's shape, layers and mask token kept)")
    ap.add_argument("--dtype", default=None, help="target dtype (default: bf16 on GPU, float32 on CPU)")
    ap.add_argument("--block-size", type=int, default=16, help="DFLASH: tokens a draft pass proposes, the root included")
    ap.add_argument("--draft-layers", type=int, default=3, help="DFLASH: drafter layers (and target feature layers)")
    ap.add_argument("--feature-layers", type=int, default=None,
                    help="DFLASH: target layers feeding the context, evenly spaced (default: --draft-layers)")
    ap.add_argument("--anchors", type=int, default=8, help="DFLASH: blocks trained per sequence")
    return ap.parse_args(argv)


def main(argv=None):
    train(parse_args(argv))


def train(args, target=None, tokenizer=None):
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from jaxspec.models.loading import load
    start = time.time()
    os.makedirs(args.run, exist_ok=True)
    if target is None:
        target, tokenizer = load(args.model, getattr(jnp, args.dtype) if args.dtype else None)
    data_path = args.data or os.path.join(args.run, "data.npz")
    if args.data and not os.path.exists(args.data):
        raise FileNotFoundError(f"--data {args.data}: no such corpus (a data.npz that --data-only writes)")
    if os.path.exists(data_path):
        d = np.load(data_path)
        tokens, lengths = d["tokens"], d["lengths"]
    else:
        t0 = time.time()
        seqs, plens = build_data(target, tokenizer, args.num_prompts, args.max_new_tokens, args.sampled_fraction,
                                 args.seed, args.gen_batch)
        tokens, lengths = pack(seqs, args.seq_len)
        np.savez_compressed(data_path, tokens=tokens, lengths=lengths, prompt_lengths=np.array(plens, np.int32),
                 seconds=time.time() - t0)
        print(f"data: {len(seqs)} sequences, {int(lengths.sum())} tokens in {time.time() - t0:.0f} s")
    if args.data_only:
        return None, 0
    n_val = max(1, int(len(tokens) * args.val_fraction))
    val_tok, val_len = tokens[:n_val], lengths[:n_val]
    tr_tok, tr_len = tokens[n_val:], lengths[n_val:]
    vd = min(args.draft_vocab, target.cfg.vocab_size) if args.kind == "eagle3" else target.cfg.vocab_size
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10 + 1), args.steps, args.lr * 0.05)
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(sched, b2=0.95, weight_decay=0.0))
    if args.kind == "dflash":
        from jaxspec import train_dflash
        head = train_dflash.drafter_for_run(args, target, tokens, lengths)
        cfg = head.cfg
        graph, params, rest = nnx.split(head, nnx.Param, ...)
        step_fn, eval_fn, t_state = train_dflash.make_train_step(target, graph, rest, tx, cfg, args.anchors, args.seed)
        coverage = None
    elif args.init_from:  # go on training a shipped head: its draft vocabulary stays
        from jaxspec.drafters.eagle import load_head
        head = load_head(args.init_from, target.cfg, target)
        cfg = head.cfg
        if cfg.kind != args.kind:
            raise ValueError(f"--init-from {args.init_from} holds an {cfg.kind} head, not {args.kind}")
        hot = np.asarray(head.draft_to_target[...]) if cfg.kind == "eagle3" else np.arange(target.cfg.vocab_size)
        vd = len(hot)
        counts = np.bincount(tr_tok[np.arange(tr_tok.shape[1])[None] < tr_len[:, None]], minlength=target.cfg.vocab_size)
        coverage = float(counts[hot].sum() / max(counts.sum(), 1))
        graph, params, rest = nnx.split(head, nnx.Param, ...)
        step_fn, eval_fn, t_state = make_train_step(target, graph, rest, tx, jnp.asarray(hot), cfg, args.ttt)
    else:
        hot, coverage = draft_vocabulary(tr_tok, tr_len, target.cfg.vocab_size, vd)
        cfg = HeadConfig.for_target(target.cfg, args.kind, draft_vocab_size=vd, intermediate_size=args.intermediate_size)
        head = init_head(target, cfg, hot, args.seed)
        graph, params, rest = nnx.split(head, nnx.Param, ...)
        step_fn, eval_fn, t_state = make_train_step(target, graph, rest, tx, jnp.asarray(hot), cfg, args.ttt)
    opt_state = tx.init(params)

    ckpt = ocp.CheckpointManager(os.path.abspath(os.path.join(args.run, "checkpoints")),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2))
    step = 0
    if ckpt.latest_step() is not None:
        step = ckpt.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": opt_state})
        restored = ckpt.restore(step, args=ocp.args.StandardRestore(abstract))
        params, opt_state = restored["params"], restored["opt"]
        print(f"resumed from step {step}")
    metrics_path = os.path.join(args.run, "metrics.jsonl")
    per_epoch = max(1, len(tr_tok) // args.batch)
    bar = tqdm(total=args.steps, initial=step, desc="train", mininterval=5)
    deadline = None if args.max_minutes is None else start + args.max_minutes * 60
    acc_sum, loss_sum, n_sum = 0.0, 0.0, 0
    with open(metrics_path, "a") as mf:
        while step < args.steps:
            epoch, k = divmod(step, per_epoch)
            order = np.random.default_rng(args.seed + epoch).permutation(len(tr_tok))
            idx = order[k * args.batch:(k + 1) * args.batch]
            params, opt_state, loss, accs = step_fn(params, opt_state, t_state, tr_tok[idx], tr_len[idx], step)
            step += 1
            bar.update(1)
            loss_sum, acc_sum, n_sum = loss_sum + loss, acc_sum + accs, n_sum + 1
            if step % args.log_every == 0 or step == args.steps:
                row = dict(split="train", step=step, loss=float(loss_sum / n_sum),
                           acc=[float(a) for a in np.asarray(acc_sum / n_sum)], seconds=time.time() - start)
                mf.write(json.dumps(row) + "\n")
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc1=f"{row['acc'][0]:.3f}")
                acc_sum, loss_sum, n_sum = 0.0, 0.0, 0
            if step % (args.log_every * 4) == 0 or step == args.steps:
                vl, aux = eval_fn(params, t_state, val_tok[:args.batch], val_len[:args.batch])
                row = dict(split="val", step=step, loss=float(vl), acc=[float(a) for a in np.asarray(aux[1])],
                           seconds=time.time() - start)
                if len(aux) > 2:  # DFLASH: share of blocks accepted through each position
                    row["accepted_through"] = [float(a) for a in np.asarray(aux[2])]
                mf.write(json.dumps(row) + "\n")
            mf.flush()
            out_of_time = deadline is not None and time.time() > deadline
            if step % args.save_every == 0 or step == args.steps or out_of_time:
                ckpt.save(step, args=ocp.args.StandardSave({"params": params, "opt": opt_state}))
            if out_of_time and step < args.steps:
                print(f"stopping at step {step} (--max-minutes); run again to resume")
                break
    bar.close()
    ckpt.wait_until_finished()
    clock_path = os.path.join(args.run, "clock.json")  # wall time summed over resumed runs
    clock = json.load(open(clock_path)) if os.path.exists(clock_path) else {"train_seconds": 0.0}
    clock["train_seconds"] += time.time() - start
    json.dump(clock, open(clock_path, "w"))
    head = nnx.merge(graph, params, rest)
    plot_curves(metrics_path, args.run)
    if args.export:  # also after a --max-minutes stop: the card says how many steps ran
        out = head
        if args.export_dtype != "float32":
            dt = getattr(jnp, args.export_dtype)
            g, st = nnx.split(head)
            out = nnx.merge(g, jax.tree.map(lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a, st))
        if args.kind == "dflash":
            from jaxspec.drafters.dflash import export_dflash
            export_dflash(out, args.export, target.cfg)
        else:
            export_head(out, args.export, target.cfg)
        rows = [json.loads(l) for l in open(metrics_path)]
        held_out = held_out_accept(eval_fn, params, t_state, val_tok, val_len, args.batch) if args.kind == "dflash" else {}
        val = [r for r in rows if r["split"] == "val"]
        d = np.load(data_path)
        # the card names the target without a machine path
        card = dict(target=os.path.basename(args.model.rstrip(os.sep)), kind=args.kind,
                    sequences=int(len(tokens)), tokens=int(lengths.sum()),
                    train_sequences=int(len(tr_tok)), steps=int(step), planned_steps=args.steps, batch=args.batch,
                    seq_len=args.seq_len, lr=args.lr,
                    **(dict(init_from=os.path.basename(os.path.normpath(args.init_from))) if args.init_from else {}),
                    **(dict(block_size=cfg.block_size, draft_layers=cfg.num_layers, anchors=args.anchors,
                            target_layer_ids=list(cfg.target_layer_ids), mask_token=cfg.mask_token)
                       if args.kind == "dflash" else dict(draft_vocab=int(vd), draft_vocab_coverage=coverage, ttt=args.ttt)),
                    data_seconds=float(d["seconds"]) if "seconds" in d else None,
                    final_val_acc=val[-1]["acc"] if val else None, final_val_loss=val[-1]["loss"] if val else None,
                    **held_out,
                    train_seconds=clock["train_seconds"], device=jax.devices()[0].device_kind,
                    params=int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(head, nnx.Param)))))
        with open(os.path.join(args.export, "card.json"), "w") as f:
            json.dump(card, f, indent=1)
        print(json.dumps(card, indent=1))
    return head, step


if __name__ == "__main__":
    main()
