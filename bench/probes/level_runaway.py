"""The auto policy alone (no engine) fed DFLASH-shaped calls at batch 64: chains of 4, 8 and 16
(each call with its cuts' counts, so the links place the chains) and the block's top-4 tree (no
cuts), a tree call most of the time, row-steps a call from 1 to 250, the requests' drafts drifting
call to call, and some calls of a few row-steps that accept nothing (in the engine: a call whose
other rows' first steps verified another shape's drafts). Reports how far the tree's expectation
strays from its own average (once it has 32 row-steps): in spec-dflash-s85- the policy expected 7.5-11
tokens a step of a tree that accepted ~2.4. CPU only: nothing runs on a device.

    python bench/probes/level_runaway.py [--seeds 300] [--calls 400] [--tag -before]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from common import print_table, results_tag, write_results  # noqa: E402
from jaxspec.drafters.eagle_step import TreeShape  # noqa: E402
from jaxspec.spec_policy import SpecPolicy, StepCosts  # noqa: E402

C4, C8, C16, TREE = TreeShape(15, 1, 4), TreeShape(15, 1, 8), TreeShape(15, 1, 16), TreeShape(15, 4, 32)
SHAPES = [C4, C8, C16, TREE]
CUTS = {C4: (), C8: (C4,), C16: (C4, C8), TREE: ()}  # DFlashDrafter.cut_shapes: no chain is a cut of the tree
DRAFTS = {C4: 0.95, TREE: 1.42}  # mean drafts a row-step; the longer chains add a few to the chain of 4's


def one_run(seed, calls, shock_rows, shock_rate):
    """The worst ratio of the tree's expected tokens a step to its own average over one run of calls."""
    rng = np.random.default_rng(seed)
    policy = SpecPolicy(StepCosts(), {64: SHAPES})
    worst = 1.0
    for call in range(calls):
        tree = SHAPES[rng.integers(4)] if rng.random() < 0.3 else TREE
        n = int(rng.choice([1, 2, 5, 16, 64, 250]))
        drift = np.exp(rng.normal(0, 0.25))
        base = rng.poisson(DRAFTS[C4] * drift, n)
        more = {C8: rng.poisson(0.05, n), C16: rng.poisson(0.07, n)}
        drafts = rng.poisson(DRAFTS[TREE] * drift, n) if tree is TREE else base + sum(
            more[u] for u in (C8, C16) if SHAPES.index(u) <= SHAPES.index(tree))
        emitted = np.ones(n, int) if n <= shock_rows and rng.random() < shock_rate else 1 + np.minimum(drafts, tree.steps)
        cut = None
        if CUTS[tree]:  # a cut of a chain emits what the chain did, up to its own length
            cut = (CUTS[tree], np.stack([emitted] + [np.minimum(emitted, u.num_draft_tokens) for u in CUTS[tree]], 1))
        policy.verified(tree, emitted.tolist(), None, 64, cut)
        if rng.random() < 0.2:
            policy.arrived(64, "plain", float(call), steps=int(rng.integers(1, 9)))
        e = policy.expected(TREE)
        if e is not None and policy.totals[(TREE, None)][1] >= 32:
            worst = max(worst, e / policy.emitted[(TREE, None)])
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--tag", type=results_tag, default="")
    args = ap.parse_args()
    rows = []
    for shock_rows, shock_rate, label in ((5, 0.3, "tiny calls accept nothing"), (250, 0.03, "any call accepts nothing")):
        worst = np.array([one_run(s, args.calls, shock_rows, shock_rate) for s in range(args.seeds)])
        rows.append(dict(shocks=label, seeds=args.seeds, calls=args.calls, worst_ratio=float(worst.max()),
                         median_worst_ratio=float(np.median(worst)), seeds_over_1_5x=int((worst > 1.5).sum()),
                         seeds_over_3x=int((worst > 3).sum())))
    print_table(rows, ["shocks", "worst_ratio", "median_worst_ratio", "seeds_over_1_5x", "seeds_over_3x"])
    write_results("level_runaway" + args.tag, rows)


if __name__ == "__main__":
    main()
