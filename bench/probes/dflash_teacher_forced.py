"""Is the shipped DFLASH drafter's low accept length the engine's doing or the drafter's?

The drafter's card reports a teacher-forced accept length on held-out training text (2.7 for the
first drafter, 4.08 for the retrained one) while the engine accepted 1.44 (then 1.81) tokens a
step on MT-bench. Here both are measured on the same
text: the engine decodes greedily with DFLASH, then the drafter runs densely (train_dflash.
block_forward, as training evaluates it) at every position of that greedy output, and a block's
accept length is 1 + how many of its drafts match the output in a row. Averaged over every
position (as the card's number is) this counts the easy stretches inside long accepted runs
that the engine steps over; walked as the engine walks (each step's block starts where the last
step's accepted run ended) it must give the engine's own accept lengths, step for step. If it
does, the engine drafts what the drafter was trained to draft, and the gap is the drafter's. SmolLM2 with
the shipped drafter, MT-bench first turns (evaluation prompts; nothing here trains):

    python bench/probes/dflash_teacher_forced.py [--prompts 4] [--max-tokens 64]
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


def block_accepts(drafts, seq, anchors) -> list:
    """Each anchor's block accept length: 1 + how many of its drafts [K, n-1] match seq in a row."""
    out = []
    for k, a in enumerate(anchors):
        m = 0
        while m < drafts.shape[1] and drafts[k, m] == seq[a + 1 + m]:
            m += 1
        out.append(1 + m)
    return out


def engine_walk(lengths, start) -> list:
    """The engine's walk over per-anchor accept lengths (anchors start, start + 1, ...): a step at
    anchor a emits its accepted drafts and the bonus token, and the next step's block starts at the
    last of them (blocks past the text's end not judged)."""
    walk, a = [], start
    while a - start < len(lengths):
        walk.append(lengths[a - start])
        a += walk[-1]
    return walk


def target_features(model, head, seq):
    """The target's layer outputs the drafter reads, over the whole text (dense, causal)."""
    from jaxspec.models.llama import dense_forward
    width = 1 << int(np.ceil(np.log2(len(seq))))
    padded = jnp.zeros((1, width), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq))
    return dense_forward(model, padded, head.cfg.target_layer_ids)[1]


def draft_outputs(model, head, layers, seq, anchors, fill=None):
    """The drafter's outputs at block positions 1.. [K, n-1, H] (before its norm) for a block at each
    anchor: [seq[a], mask x (n-1)], or fill [K, n-1] in place of the masks."""
    from jaxspec.train_dflash import block_forward
    n = head.cfg.block_size
    blocks = jnp.full((1, len(anchors), n), head.cfg.mask_token, jnp.int32).at[0, :, 0].set(
        jnp.asarray([seq[a] for a in anchors]))
    if fill is not None:
        blocks = blocks.at[0, :, 1:].set(jnp.asarray(fill))
    return block_forward(head, model, layers, jnp.asarray([anchors]), blocks)[0, :, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from jaxspec import Generator, SamplingParams, SpecConfig
    from jaxspec.drafters.dflash import load_dflash
    from jaxspec.models.loading import load
    from jaxspec.speculative import shipped_drafter
    model, tok = load("smollm2-135m")
    prompts = mt_bench_token_ids(tok, args.prompts)
    gen = Generator(model, tok, drafter=SpecConfig("DFLASH").build(model, "smollm2-135m"), max_batch=len(prompts),
                    max_seq_len=1024, warmup=False)
    outs = gen.generate(prompts, SamplingParams(max_tokens=args.max_tokens))
    head = load_dflash(shipped_drafter("smollm2-135m", "DFLASH"), model.cfg)
    n = head.cfg.block_size
    rows = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        seq = p + o.token_ids
        layers = target_features(model, head, seq)
        anchors = list(range(len(p), len(seq) - n))  # every generated position with a whole block after it
        out = draft_outputs(model, head, layers, seq, anchors)
        drafts = np.asarray(jnp.argmax(head.logits(model, out), -1))
        lengths = block_accepts(drafts, seq, anchors)
        walk = engine_walk(lengths, len(p))
        rows.append(dict(prompt=i, tokens=len(o.token_ids), engine_accept_length=o.mean_accept_length,
                         engine_steps=len(o.accept_lengths), walk_accept_length=float(np.mean(walk)),
                         walk_steps=len(walk), walk_equals_engine=walk == o.accept_lengths[:len(walk)],
                         teacher_forced_accept_length=float(np.mean(lengths)),
                         first_draft_right=float(np.mean(drafts[:, 0] == np.array([seq[a + 1] for a in anchors])))))
        print(rows[-1], flush=True)
    print_table(rows, ["prompt", "engine_accept_length", "walk_accept_length", "walk_equals_engine",
                       "teacher_forced_accept_length", "first_draft_right"])
    print(write_results("dflash_teacher_forced", rows))


if __name__ == "__main__":
    main()
