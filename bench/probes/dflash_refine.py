"""Would a second drafter pass make the DFLASH block better where it is weakest, its later positions?

The shipped drafter proposes a block in one pass from [last token, mask x (n-1)]; its held-out top-1
agreement falls from 0.73 at the first drafted position to 0.38 by the fourth (its card), where the
EAGLE-3 head's chain, which sees its own earlier drafts, holds 0.79-0.76. Here, on the target's own
greedy answers to MT-bench first turns (evaluation prompts; nothing here trains), every answer
position gets the one-pass block and a second pass whose block holds the first pass's drafts in
place of the masks (a denoising step of block diffusion, which the drafter never saw in training).
Rows: per-position agreement with the target's text and the accept length walked as the engine
walks (each step's block starts where the last accepted run ended), for pass 1, pass 2, and pass 2
keeping pass 1's first draft (the one position the masks do not hurt).

    python bench/probes/dflash_refine.py [--prompts 8] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import mt_bench_token_ids, print_table, write_results  # noqa: E402
from dflash_teacher_forced import block_accepts, draft_outputs, engine_walk, target_features  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    from jaxspec import Generator, SamplingParams
    from jaxspec.drafters.dflash import load_dflash
    from jaxspec.models.loading import load
    from jaxspec.speculative import shipped_drafter
    model, tok = load("smollm2-135m")
    prompts = mt_bench_token_ids(tok, args.prompts)
    outs = Generator(model, tok, max_batch=len(prompts), max_seq_len=1024, warmup=False).generate(
        prompts, SamplingParams(max_tokens=args.max_tokens))
    head = load_dflash(shipped_drafter("smollm2-135m", "DFLASH"), model.cfg)
    n = head.cfg.block_size
    kinds = ("pass 1", "pass 2", "pass 2, first draft of pass 1")
    right = {k: [] for k in kinds}
    walks = {k: [] for k in kinds}
    for p, o in zip(prompts, outs):
        seq = p + o.token_ids
        layers = target_features(model, head, seq)
        anchors = list(range(len(p), len(seq) - n))  # every answer position with a whole block after it
        if not anchors:
            continue
        draft = lambda fill: np.asarray(jnp.argmax(head.logits(model, draft_outputs(model, head, layers, seq, anchors,
                                                                                    fill)), -1))
        d1 = draft(None)
        d2 = draft(d1[:, :n - 1])
        mixed = np.concatenate([d1[:, :1], d2[:, 1:]], axis=1)
        want = np.array([[seq[a + 1 + i] for i in range(n - 1)] for a in anchors])
        for kind, d in zip(kinds, (d1, d2, mixed)):
            right[kind].append(d == want)
            walks[kind] += engine_walk(block_accepts(d, seq, anchors), len(p))
    rows = []
    for kind in kinds:
        r = np.concatenate(right[kind])
        rows.append(dict(draft=kind, blocks=len(r), walk_steps=len(walks[kind]),
                         walk_accept_length=float(np.mean(walks[kind])),
                         top1_by_position=[round(float(x), 3) for x in r.mean(0)[:8]],
                         right_through=[round(float(x), 3) for x in np.cumprod(r, axis=1).mean(0)[:8]]))
        print(rows[-1], flush=True)
    print_table(rows, ["draft", "blocks", "walk_steps", "walk_accept_length"])
    print(write_results("dflash_refine", rows))


if __name__ == "__main__":
    main()
