"""How much more a device drafter's bigger tree accepts than its smaller ones, measured on the very
same verify steps: each verify call also returns what the cut of its tree to each smaller shape
would have emitted (verify.cut_counts), so two shapes are compared without the requests
moving between them. The auto policy (spec_policy.py) takes these differences in place of the ones
it measures against the requests' level, once they are known: at batch 1 a probe of three calls
compares a shape with the one held before it across different requests (SmolLM2 + EAGLE-3 on
MT-bench, H200: auto held 4:2:8 and ran at 0.87x fixed 6:4:24, spec-policy-b1-64-NVIDIA-H200.json).

The shapes form a chain by nodes, then depth, each standing for a cut of the next (as deep and as
many nodes at most; every auto_trees() set is one). A link is the log of the smaller's drafts
accepted a row-step less the bigger's, averaged over the row-steps of every call whose tree holds
both; a shape's difference is the sum of the links from the smallest up to it. A cut of a bigger
tree stands for the smaller shape's own tree (whose top-k may differ; not a DFLASH chain, which drafts
every position of its block: DFlashDrafter.cut_shapes); the engine verifies such a cut for a call's
first step after a change of shape, too.

Measured with the drafted nodes in creation order (depth-major, so that a cut kept the shallow
nodes, not the best), choosing by the links overrated the biggest tree (spec-policy-cuts-). With
drafts kept best first (eagle_step.select_tree), the same run against the level (spec-policy-links-,
H200, b1 / 8 / 64) had the links ahead at batch 1 (0.99x / 1.04x the best fixed tree on MT-bench /
HumanEval, against the level's 0.96x / 1.02x), as far or ahead at batch 8 (0.97x / 1.00x against
0.97x / 0.97x), 0.86x / 0.92x against 0.88x / 0.89x at 64: spec_policy.USE_LINKS is on
(bench/spec.py's /auto-level turns it off)."""
from __future__ import annotations

import numpy as np

from jaxspec.spec_shapes import is_tree


class ShapeLinks:
    def __init__(self, shapes, kept: int, min_drafts: float):
        """shapes: the policy's (plain decoding and host trees left out); kept: row-steps past which a
        link's sums are halved (the requests move); min_drafts: a mean's floor before its log."""
        shapes = sorted({t for t in shapes if is_tree(t, t)}, key=lambda t: (t.num_draft_tokens, t.steps))
        cuts = all(a.steps <= b.steps and a.num_draft_tokens <= b.num_draft_tokens for a, b in zip(shapes, shapes[1:]))
        self.chain = shapes if cuts else []  # not a chain of cuts: no links, the level's own differences
        self.kept, self.min_drafts = kept, min_drafts
        self.sums: dict = {}  # (shape, the next bigger) -> [row-steps x log drafts difference, row-steps]

    def __getitem__(self, pair):
        return self.sums[pair]

    def add(self, tree, shapes, counts) -> None:
        """A call of `tree`: counts [row-steps, 1 + len(shapes)], what it emitted and what its cut to
        each of `shapes` would have, on the same row-steps."""
        if not len(counts):
            return
        x = dict(zip((tree,) + tuple(shapes), np.log(np.maximum(counts.mean(axis=0) - 1.0, self.min_drafts))))
        for small, big in zip(self.chain, self.chain[1:]):
            if small in x and big in x:
                link = self.sums.setdefault((small, big), [0.0, 0])
                link[0], link[1] = link[0] + len(counts) * (x[small] - x[big]), link[1] + len(counts)
                if link[1] > self.kept:
                    link[0], link[1] = link[0] / 2, link[1] / 2

    def diff(self, tree) -> float | None:
        """The tree's log drafts less the smallest shape's, or None where a link below it (or any)
        was never measured."""
        if tree not in self.chain or not self.sums:
            return None
        total = 0.0
        for pair in zip(self.chain, self.chain[1:self.chain.index(tree) + 1]):
            if pair not in self.sums:
                return None
            total -= self.sums[pair][0] / self.sums[pair][1]
        return total
