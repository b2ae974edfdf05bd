"""Does the shipped DFLASH drafter draft its first positions as well from a shorter block? At batch
64 the policy verifies chains of 4 (15:1:4): three drafted tokens, from a pass over the whole block
of 16 (the root and 15 masks through every drafter layer, logits at 3 positions). A block of n < 16
would cost the drafter's pass about n / 16 of its rows, if the masks past the chain add little to
what the first positions predict (the block is non-causal: they are attended to).

Teacher-forced on held-out self-generated text (the first sequences of seed 0's corpus: its card
holds out its first 2%, never MT-bench or HumanEval): for blocks of 16, 8 and 4 at the same random
anchors, the share of blocks whose drafts 1..j all match the target's greedy tokens (what a chain
of j + 1 accepts), and the implied accept length of chains of 4. CPU is enough (SmolLM2, float32).

    python bench/probes/dflash_short_block.py [--sequences 64] [--anchors 16] [--blocks 16,8,4]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import print_table, results_tag, write_results  # noqa: E402
from jaxspec.drafters.dflash import load_dflash  # noqa: E402
from jaxspec.models.llama import dense_forward  # noqa: E402
from jaxspec.models.loading import load  # noqa: E402
from jaxspec.speculative import shipped_drafter  # noqa: E402
from jaxspec.train_dflash import block_forward  # noqa: E402

CORPUS = "data/smollm2-135m-selfgen-seed0/data.npz"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--blocks", default="16,8,4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tag", type=results_tag, default="")
    args = ap.parse_args()
    model, _ = load("smollm2-135m", jnp.float32)
    head = load_dflash(shipped_drafter("smollm2-135m", "DFLASH"), model.cfg)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    data = np.load(os.path.join(root, CORPUS))
    tokens, lengths, prompts = data["tokens"], data["lengths"], data["prompt_lengths"]
    blocks = [int(n) for n in args.blocks.split(",")]
    depth = min(blocks) - 1  # drafted positions every block size has
    rng = np.random.default_rng(0)
    through = {n: np.zeros(depth) for n in blocks}
    count = 0

    @jax.jit
    def features(tok):
        h, layers = dense_forward(model, tok, hidden_layers=head.cfg.target_layer_ids)
        return jnp.argmax(model.logits(h), -1), layers

    for i in range(0, args.sequences, args.batch):
        tok = jnp.asarray(tokens[i:i + args.batch])
        greedy, layers = features(tok)  # greedy[b, p]: the target's token after position p
        b = tok.shape[0]
        lo, hi = prompts[i:i + b], lengths[i:i + b] - depth - 1  # anchors in the answers, depth tokens ahead
        a = np.stack([rng.integers(lo[j], max(hi[j], lo[j] + 1), args.anchors) for j in range(b)])
        ok = a < hi[:, None]
        want = np.take_along_axis(np.asarray(greedy), (a[:, :, None] + np.arange(depth)).reshape(b, -1), 1)
        want = want.reshape(b, args.anchors, depth)  # the target's greedy tokens a+1 .. a+depth
        for n in blocks:
            blk = np.full((b, args.anchors, n), head.cfg.mask_token, np.int32)
            blk[:, :, 0] = np.take_along_axis(np.asarray(tok), a, 1)
            out = block_forward(head, model, layers, jnp.asarray(a), jnp.asarray(blk))[:, :, 1:1 + depth]
            drafted = np.asarray(jnp.argmax(head.logits(model, out), -1))
            right = np.cumprod(drafted == want, axis=-1)
            through[n] += (right * ok[:, :, None]).sum((0, 1))
        count += int(ok.sum())
    rows = [dict(block=n, blocks_drafted=count, accepted_through=[round(float(x) / count, 4) for x in through[n]],
                 chain4_accept_length=round(1 + float(through[n][:3].sum()) / count, 4)) for n in blocks]
    print_table(rows, ["block", "blocks_drafted", "accepted_through", "chain4_accept_length"])
    write_results("dflash_short_block" + args.tag, rows)


if __name__ == "__main__":
    main()
