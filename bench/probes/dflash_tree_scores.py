"""Would DFLASH's tree accept more if its node scores were the drafter's odds given a right prefix?

tree_from_marginals ranks a node by the sum of its path's per-position log-probs, each position's
distribution drawn from one pass over [root, mask x n-1] (Medusa's independence). Those marginals
are the drafter's odds of being right whatever came before; the tree pays off only where the path
above it was right, and there the shipped drafter is right far more often: its held-out top-1
agreement falls 0.73, 0.59, 0.48, 0.38 ... by position, while the share right given the position
before was right stays 0.69-0.95 (its card's accepted_through, ratio by ratio). So the tree spends
its nodes wide near the root. Here each depth d's log-probs get a bias b_d = scale * log(that
conditional share / the top-1 agreement at d), clipped at 0 (a node never outscores its parent),
and the same blocks' trees are judged against the target's own greedy text: accept length at every
answer position and walked as the engine walks. Same nodes, same programs: only the selection moves.
Float32 CPU, dense blocks (train_dflash.block_forward), MT-bench first turns (nothing here trains).

    python bench/probes/dflash_tree_scores.py [--prompts 24] [--trees 15:4:32,15:8:64] [--scales 0,0.5,1] [--tag -x]

With --scales 0 it compares tree shapes alone: at 32 nodes a wider top-k at each position accepted more
(dflash_tree_scores-widths-cpu.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import humaneval_prompts, mt_bench_token_ids, print_table, write_results  # noqa: E402
from dflash_teacher_forced import draft_outputs, engine_walk, target_features  # noqa: E402


def depth_bias(card_stage: dict) -> np.ndarray:
    """log(share right given the position before was right / top-1 agreement), by drafted position."""
    acc = np.asarray(card_stage["held_out_acc"], np.float64)
    through = np.asarray(card_stage["held_out_accepted_through"], np.float64)
    given = np.concatenate([through[:1], through[1:] / through[:-1]])
    return np.log(given / acc)


def tree_accepts(tokens, parents, seq, anchors) -> list:
    """1 + the depth of the deepest node whose path from the root matches seq after each anchor."""
    out = []
    for k, a in enumerate(anchors):
        node, depth = 0, 0
        while True:
            want = seq[a + 1 + depth] if a + 1 + depth < len(seq) else -1
            nxt = [j for j in range(1, tokens.shape[1]) if parents[k, j] == node and tokens[k, j] == want]
            if not nxt:
                break
            node, depth = nxt[0], depth + 1
        out.append(1 + depth)
    return out


def _depths(parents) -> np.ndarray:
    """Each node's depth (root 0) from parents [B, N] listed parents first."""
    depth = np.zeros(parents.shape, np.int64)
    for j in range(1, parents.shape[1]):
        depth[:, j] = depth[np.arange(parents.shape[0]), parents[:, j]] + 1
    return depth


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--trees", default="15:4:32,15:8:64")
    ap.add_argument("--scales", default="0,0.5,1")
    ap.add_argument("--dataset", choices=["mt-bench", "humaneval"], default="mt-bench")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args()
    from jaxspec import Generator, SamplingParams
    from jaxspec.drafters.dflash import load_dflash
    from jaxspec.drafters.dflash_step import tree_from_marginals
    from jaxspec.drafters.eagle_step import TreeShape
    from jaxspec.models.loading import load
    from jaxspec.speculative import shipped_drafter
    model, tok = load("smollm2-135m")
    prompts = (mt_bench_token_ids(tok, args.prompts) if args.dataset == "mt-bench"  # (HumanEval: raw text to complete)
               else [tok.encode(p, add_special_tokens=False) for p in humaneval_prompts()[:args.prompts]])
    outs = Generator(model, tok, max_batch=8, max_seq_len=1024, warmup=False).generate(
        prompts, SamplingParams(max_tokens=args.max_tokens))
    path = shipped_drafter("smollm2-135m", "DFLASH")
    head = load_dflash(path, model.cfg)
    bias = depth_bias(json.load(open(os.path.join(path, "card.json")))["stages"][-1])
    trees = [TreeShape.parse(t) for t in args.trees.split(",")]
    scales = [float(s) for s in args.scales.split(",")]
    build = jax.jit(tree_from_marginals, static_argnums=2)
    found = {(t.label, s): ([], []) for t in trees for s in scales}  # (every anchor's, the walk's)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        print(f"prompt {i}", flush=True)
        seq = p + o.token_ids
        anchors = list(range(len(p), len(seq) - 1))  # every answer position with a token after it
        lp = jax.nn.log_softmax(head.logits(model, draft_outputs(model, head, target_features(model, head, seq), seq,
                                                                 anchors)))
        root = jnp.asarray([seq[a] for a in anchors], jnp.int32)
        # the tree reads each position's top-k alone, and a bias a position moves none of its ranks: the
        # top 8 stand in for the vocabulary (ids mapped back after), padded to a whole 64 rows (one compile)
        top_lp, top_id = jax.lax.top_k(lp, max(t.topk for t in trees))
        rows_ = len(anchors)
        pad = -rows_ % 64
        top_lp, top_id = (np.pad(np.asarray(x), ((0, pad), (0, 0), (0, 0))) for x in (top_lp, top_id))
        for t in trees:
            for s in scales:
                shifted = np.minimum(top_lp[:, :t.steps] + s * bias[None, :t.steps, None], 0.0).astype(np.float32)
                tokens, parents = build(jnp.asarray(shifted), jnp.pad(root, (0, pad)), t)
                tokens, parents = np.asarray(tokens)[:rows_], np.asarray(parents)[:rows_]
                depth = _depths(parents)  # node j > 0 drafts rank tokens[:, j] of position depth[:, j] - 1
                ranked = top_id[np.arange(rows_)[:, None], np.maximum(depth - 1, 0), np.where(depth > 0, tokens, 0)]
                tokens = np.where(depth > 0, ranked, tokens)
                lengths = tree_accepts(tokens, parents, seq, anchors)
                found[(t.label, s)][0].extend(lengths)
                found[(t.label, s)][1].extend(engine_walk(lengths, len(p)))
    rows = []
    for (label, s), (every, walk) in found.items():
        rows.append(dict(dataset=args.dataset, tree=label, bias_scale=s, positions=len(every),
                         accept_every_position=float(np.mean(every)), walk_steps=len(walk),
                         walk_accept_length=float(np.mean(walk))))
        print(rows[-1], flush=True)
    print_table(rows, ["tree", "bias_scale", "positions", "accept_every_position", "walk_steps", "walk_accept_length"])
    print(write_results("dflash_tree_scores" + args.tag, rows, dict(depth_bias=[round(float(b), 4) for b in bias])))


if __name__ == "__main__":
    main()
