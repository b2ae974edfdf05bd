"""The host's cost of the auto policy a verify call: SpecPolicy.choose, then verified (with the
same-step cut counts, or without) and arrived, for a bucket of 32 rows over EAGLE-3's five shapes
and plain decoding, on made-up accept lengths (85 row-steps a call: 21 rows x 4 steps, as served
at concurrency 32). `shape_relations` 'uncached' recomputes contains / nested for every pair the
policy asks about, as before spec_shapes cached them; both variants run side by side.

    python bench/probes/policy_cost.py [--calls 3000]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np

from common import print_table, write_results
from jaxspec import spec_policy
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.spec_policy import PLAIN_CHOICE, SpecPolicy, StepCosts

TREES = [TreeShape.parse(t) for t in ("3:1:4", "4:2:8", "6:4:16", "6:4:24", "6:8:64")]
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def run(calls: int, cuts: bool) -> float:
    """µs a call of choose + verified + arrived (the made-up inputs drawn beforehand)."""
    costs = StepCosts()
    for r in BUCKETS:
        costs.ms[("decode", r, None)] = 1.2
        costs.ms.update({("verify", r, t.label): 1.3 + t.num_draft_tokens / 64 for t in TREES})
    policy = SpecPolicy(costs, {r: TREES + [PLAIN_CHOICE] for r in BUCKETS})
    rng = np.random.default_rng(0)
    emitted = rng.integers(1, 6, (calls, 85))
    counts = [rng.integers(1, 6, (85, len(TREES))) for _ in range(calls)]
    emitted = [e.tolist() for e in emitted]
    t0 = time.perf_counter()
    for i in range(calls):
        tree = policy.choose(32) or TREES[0]
        shapes = tuple(s for s in TREES if s != tree and s.steps <= tree.steps and s.num_draft_tokens <= tree.num_draft_tokens)
        policy.verified(tree, emitted[i], None, 32, (shapes, counts[i][:, :1 + len(shapes)]) if cuts else None)
        policy.arrived(32, tree.label, 0.008 * (i + 1), 4, True)
    return 1e6 * (time.perf_counter() - t0) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    cached = spec_policy.contains, spec_policy.nested
    rows = []
    for relations in ("uncached", "cached"):
        if relations == "uncached":  # the functions under spec_shapes' functools.cache
            spec_policy.contains, spec_policy.nested = (f.__wrapped__ for f in cached)
        else:
            spec_policy.contains, spec_policy.nested = cached
        for cuts in (False, True):
            rows.append(dict(shape_relations=relations, cut_counts=cuts, calls=args.calls,
                             us_per_call=min(run(args.calls, cuts) for _ in range(3))))
    print_table(rows, ["shape_relations", "cut_counts", "us_per_call"])
    write_results("policy_cost", rows)


if __name__ == "__main__":
    main()
