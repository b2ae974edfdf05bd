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
   at every step (train_eagle.py), on sequences packed into rows of `--pack-len`. optax AdamW;
   orbax checkpoints every `--save-every` steps and when `--max-minutes` runs out, so a run stops
   and resumes cleanly. `--drafter dflash` trains a
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

from jaxspec import train_eagle
from jaxspec.drafters.eagle import export_head
from jaxspec.train_data import answer_temperatures, build_data, pack, pack_rows

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
    if val and "accepted_through" in val[0]:  # the accept length greedy verification would reach
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["step"] for r in val], [1 + sum(r["accepted_through"]) for r in val], "o-",
                label="from every position")
        if "walk_accept_length" in val[0]:
            ax.plot([r["step"] for r in val], [r["walk_accept_length"] for r in val], "o-", label="walked as the engine")
        ax.legend()
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out accept length (greedy, one chain)")
        fig.tight_layout()
        path = os.path.join(out_dir, "accept_length.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


# -- driver -------------------------------------------------------------------------------------------------
def held_out(eval_fn, params, t_state, tokens, lengths, prompt_lengths, batch: int, max_batches=None) -> dict:
    """The drafter on held-out greedy answers, `batch` sequences a call (the last call's rows
    repeat earlier ones: one program shape): loss, top-1 agreement and the share of drafts right
    through each position (DFLASH: a block's; EAGLE: the unrolled chain's), whose sum plus one is
    the accept length greedy verification of one chain would reach on this text."""
    n = len(tokens) if max_batches is None else min(len(tokens), max_batches * batch)
    loss, acc, through, walked = [], [], [], []
    for i in range(0, n, batch):
        rows = np.arange(i, i + batch) % n
        vl, (_, a, t, *right) = eval_fn(params, t_state, tokens[rows], lengths[rows], prompt_lengths[rows])
        loss.append(float(vl))
        acc.append(np.asarray(a))
        through.append(np.asarray(t))
        if right:  # EAGLE: the chain walked along each text as the engine walks it
            m = min(batch, n - i)
            walked.append(train_eagle.walk_accept_length(right[0][:, :m], lengths[rows][:m], prompt_lengths[rows][:m]))
    through = np.mean(through, 0)
    return dict(sequences=int(n), loss=float(np.mean(loss)), acc=[round(float(a), 4) for a in np.mean(acc, 0)],
                accepted_through=[round(float(a), 4) for a in through], accept_length=round(1 + float(through.sum()), 3),
                **(dict(walk_accept_length=round(sum(w[0] for w in walked) / max(sum(w[1] for w in walked), 1), 3))
                   if walked else {}))


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
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="EAGLE-3 draft vocabulary: a fresh head's most frequent target ids (default 4096); with "
                         "--init-from, a larger size grows the head's own (its ids and rows kept)")
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
    ap.add_argument("--topics", action="store_true",
                    help="invented prompts also name a subject (train_data.TOPICS) in a system message")
    ap.add_argument("--prompts", choices=["chat", "code"], default="chat",
                    help="what the target answers: chat prompts it invents, or the standard library's functions to "
                         "complete (signature and docstring, no chat template; at most --num-prompts, distinct)")
    ap.add_argument("--data", default=None,
                    help="train on this data.npz (e.g. a corpus in data/) rather than the run's; several, comma-separated, "
                         "are concatenated in order")
    ap.add_argument("--init-from", default=None,
                    help="start from this exported head or DFLASH drafter, not a fresh one (an EAGLE-3 head's draft "
                         "vocabulary, a DFLASH drafter's shape, layers and mask token kept)")
    ap.add_argument("--dtype", default=None, help="target dtype (default: bf16 on GPU, float32 on CPU)")
    ap.add_argument("--compute-dtype", default=None,
                    help="the drafter's forward and backward (float32 master weights; default: bf16 on GPU, float32 on CPU)")
    ap.add_argument("--train-sequences", type=int, default=None,
                    help="train on this many sequences of the corpus (after the held-out ones): corpus-size runs")
    ap.add_argument("--loss-on", choices=["all", "answer"], default="all",
                    help="positions the loss covers: the whole text, or the answers only (what drafting sees)")
    ap.add_argument("--capture-layers", default=None,
                    help="EAGLE-3: target layers whose outputs feed the head, e.g. 1,14,25 (default: SGLang's)")
    ap.add_argument("--pack-len", type=int, default=None,
                    help="EAGLE: pack sequences into rows of this many tokens (default: --seq-len; 0: one a row)")
    ap.add_argument("--val-batches", type=int, default=4, help="held-out batches at each logged evaluation")
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
    data_paths = args.data.split(",") if args.data else [os.path.join(args.run, "data.npz")]
    missing = [p for p in data_paths if args.data and not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"--data {missing[0]}: no such corpus (a data.npz that --data-only writes)")
    data_seconds = None
    if os.path.exists(data_paths[0]):  # several corpora: concatenated in order
        ds = [np.load(p) for p in data_paths]
        first_len = len(ds[0]["lengths"])
        tokens, lengths = np.concatenate([d["tokens"] for d in ds]), np.concatenate([d["lengths"] for d in ds])
        plens = np.concatenate([d["prompt_lengths"] if "prompt_lengths" in d else np.zeros(len(d["lengths"]), np.int32)
                                for d in ds])
        data_seconds = sum(float(d["seconds"]) for d in ds if "seconds" in d) or None
    else:
        data_path = data_paths[0]
        t0 = time.time()
        seqs, plens = build_data(target, tokenizer, args.num_prompts, args.max_new_tokens, args.sampled_fraction,
                                 args.seed, args.gen_batch, topics=args.topics, source=args.prompts)
        tokens, lengths = pack(seqs, args.seq_len)
        plens, first_len = np.array(plens, np.int32), len(lengths)
        data_seconds = time.time() - t0
        np.savez_compressed(data_path, tokens=tokens, lengths=lengths, prompt_lengths=plens, seconds=data_seconds)
        print(f"data: {len(seqs)} sequences, {int(lengths.sum())} tokens in {time.time() - t0:.0f} s")
    if args.data_only:
        return None, 0
    # held out: the first corpus's first sequences whose answers were greedy (what greedy verification
    # sees), from the answer on, whatever corpora follow it; the rest trains, cut to --train-sequences
    # for corpus-size runs
    n_val = max(1, int(first_len * args.val_fraction))
    greedy = np.flatnonzero(answer_temperatures(len(tokens), args.sampled_fraction)[:n_val] == 0)
    greedy = greedy if len(greedy) else np.arange(n_val)
    val = (tokens[greedy], lengths[greedy], plens[greedy])
    train_end = n_val + args.train_sequences if args.train_sequences else len(tokens)
    tr_tok, tr_len = tokens[n_val:train_end], lengths[n_val:train_end]
    tr_start = plens[n_val:train_end] if args.loss_on == "answer" else np.zeros(len(tr_tok), np.int32)
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10 + 1), args.steps, args.lr * 0.05)
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(sched, b2=0.95, weight_decay=0.0))
    compute = getattr(jnp, args.compute_dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
    coverage, vd = None, None
    if args.kind == "dflash":
        from jaxspec import train_dflash
        head = train_dflash.drafter_for_run(args, target, tokens, lengths)
        graph, params, rest = nnx.split(head, nnx.Param, ...)
        step_fn, eval_fn, t_state = train_dflash.make_train_step(target, graph, rest, tx, head.cfg, args.anchors,
                                                                 args.seed, compute)
    else:
        head, hot, coverage = train_eagle.head_for_run(args, target, tr_tok, tr_len)
        vd = len(hot)
        graph, params, rest = nnx.split(head, nnx.Param, ...)
        step_fn, eval_fn, t_state = train_eagle.make_train_step(target, graph, rest, tx, jnp.asarray(hot), head.cfg,
                                                                args.ttt, compute)
    cfg = head.cfg
    # what a step reads, a row each: EAGLE's sequences packed into rows (less padding), DFLASH's one a row
    pack_len = args.seq_len if args.pack_len is None and args.kind != "dflash" else args.pack_len
    if args.kind == "dflash" and pack_len:
        raise ValueError("--pack-len: a DFLASH drafter trains on one sequence a row")
    train_rows = (pack_rows(tr_tok, tr_len, tr_start, pack_len, args.seed) if pack_len else
                  (tr_tok, tr_len, tr_start) if args.kind == "dflash" else
                  (tr_tok, *map(np.asarray, train_eagle.unpacked(tr_tok, tr_len, tr_start))))
    row_tokens = (train_rows[1] > 0).sum(1) if args.kind != "dflash" else tr_len
    packing = dict(packed_rows=len(row_tokens), pack_len=pack_len,
                   packed_density=round(float(row_tokens.sum()) / (len(row_tokens) * pack_len), 3)) if pack_len else {}
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
    per_epoch = max(1, len(row_tokens) // args.batch)
    bar = tqdm(total=args.steps, initial=step, desc="train", mininterval=5)
    deadline = None if args.max_minutes is None else start + args.max_minutes * 60
    acc_sum, loss_sum, n_sum, tok_sum, t_log = 0.0, 0.0, 0, 0, time.time()
    shuffled = (None, None)  # (epoch, its order of the rows): one shuffle an epoch, not one a step
    with open(metrics_path, "a") as mf:
        while step < args.steps:
            epoch, k = divmod(step, per_epoch)
            if shuffled[0] != epoch:
                shuffled = (epoch, np.random.default_rng(args.seed + epoch).permutation(len(row_tokens)))
            idx = shuffled[1][k * args.batch:(k + 1) * args.batch]
            params, opt_state, loss, accs = step_fn(params, opt_state, t_state, *(a[idx] for a in train_rows), step)
            step += 1
            bar.update(1)
            loss_sum, acc_sum, n_sum = loss_sum + loss, acc_sum + accs, n_sum + 1
            tok_sum += int(row_tokens[idx].sum())
            if step % args.log_every == 0 or step == args.steps:
                acc = np.asarray(acc_sum / n_sum)  # waits for the step: the time below is the device's
                row = dict(split="train", step=step, loss=float(loss_sum / n_sum), acc=[float(a) for a in acc],
                           tokens_per_s=round(tok_sum / (time.time() - t_log), 1), seconds=time.time() - start)
                mf.write(json.dumps(row) + "\n")
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc1=f"{row['acc'][0]:.3f}")
                acc_sum, loss_sum, n_sum, tok_sum = 0.0, 0.0, 0, 0
            if step % (args.log_every * 4) == 0 or step == args.steps:
                row = held_out(eval_fn, params, t_state, *val, args.batch, args.val_batches)
                mf.write(json.dumps(dict(split="val", step=step, **row, seconds=time.time() - start)) + "\n")
                t_log = time.time()  # the held-out pass is not training time
            elif step % args.log_every == 0:
                t_log = time.time()
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
        dt = getattr(jnp, args.export_dtype)
        out = nnx.merge(graph, *train_eagle.floats_as((params, rest), dt))
        if args.kind == "dflash":
            from jaxspec.drafters.dflash import export_dflash
            export_dflash(out, args.export, target.cfg)
        else:
            export_head(out, args.export, target.cfg)
        final = {f"held_out_{k}": v for k, v in held_out(eval_fn, params, t_state, *val, args.batch).items()}
        rows = [json.loads(l) for l in open(metrics_path)]
        speed = [r["tokens_per_s"] for r in rows if r["split"] == "train" and "tokens_per_s" in r]
        # the card names the target without a machine path
        card = dict(target=os.path.basename(args.model.rstrip(os.sep)), kind=args.kind,
                    sequences=int(len(tokens)), tokens=int(lengths.sum()),
                    train_sequences=int(len(tr_tok)), **packing, steps=int(step), planned_steps=args.steps, batch=args.batch,
                    seq_len=args.seq_len, lr=args.lr,
                    **(dict(init_from=os.path.basename(os.path.normpath(args.init_from))) if args.init_from else {}),
                    **(dict(block_size=cfg.block_size, draft_layers=cfg.num_layers, anchors=args.anchors,
                            target_layer_ids=list(cfg.target_layer_ids), mask_token=cfg.mask_token)
                       if args.kind == "dflash" else dict(draft_vocab=int(vd), draft_vocab_coverage=coverage, ttt=args.ttt)),
                    data_seconds=data_seconds,
                    compute_dtype=jnp.dtype(compute).name, loss_on=args.loss_on,
                    train_tokens_per_s=float(np.median(speed)) if speed else None, **final,
                    train_seconds=clock["train_seconds"], device=jax.devices()[0].device_kind,
                    params=int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(head, nnx.Param)))))
        with open(os.path.join(args.export, "card.json"), "w") as f:
            json.dump(card, f, indent=1)
        print(json.dumps(card, indent=1))
    return head, step


if __name__ == "__main__":
    main()
