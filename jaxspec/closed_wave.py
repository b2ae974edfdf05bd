"""The auto policy's tree against plain decoding for a closed batch: the requests of one
Generator.generate call (bench/spec.py's waves, an evaluation loop) with nobody waiting, whose
caller has its answer when the slowest request ends.

The policy (spec_policy.py) ranks shapes by tokens a row emits per ms of a step, averaged over the
rows: the right measure while freed rows are refilled from a queue. With nobody waiting, a row that
finishes early frees nothing but its share of the bucket, and the rows that accept least set the
time. bench/probes/wave_tail.py replays the H200's per-request accept lengths at batch 64 (fixed
trees, MT-bench and HumanEval) against the step-cost table: that replay gives 0.72-1.10x plain for
the wave where the per-step estimate gives 0.83-1.43x, and the bench measured 0.73-1.07x.

So, such a batch of several rows: the tree the policy chose is run only if the batch's
rows finish sooner under it than under plain decoding, each row at its own rate. A row's rate under
the tree is 1 + its factor x the drafts the policy expects of the tree, its factor its drafts
accepted over those expected on its verified steps so far (ROW_PRIOR_DRAFTS expected drafts at
factor 1 added: the least of 64 noisy factors would otherwise decide); its tokens left are its
max_tokens less its output. The batch's time replays those steps with the bucket shrinking as rows
finish, at the policy's costs (the bucket's where a smaller one has no cost yet). A change between
the tree and plain decoding does not chain on the last call: the side it moves to pays the bucket's
launch cost (and a move to the tree a step that verifies the roots alone), so that near-tied
estimates do not flip the batch call after call (replayed with those costs, the DFLASH chain's
MT-bench wave ran 0.972x plain with them and 0.957x without: wave_tail-policies-).

A server's requests are not closed batches (each client waits for its own; they carry no group):
there the per-step rate, which every request's own time follows, decides alone.
"""
from __future__ import annotations

import numpy as np

from jaxspec.programs import BATCH_BUCKETS, bucket
from jaxspec.spec_shapes import PLAIN

ROW_PRIOR_DRAFTS = 16.0  # (wave_tail.py's replay: 4, 8 and 16 kept the trees' gains best at 16; wave_tail-policies-)


def wave_ms(steps, cost_at) -> float:
    """ms until the last row ends: rows needing `steps` steps each, a step at the bucket of the
    rows still running costing cost_at(bucket) ms."""
    left = np.sort(np.asarray(steps, dtype=float))[::-1].tolist()
    total, done, costs = 0.0, 0.0, {}  # (one cost_at a bucket: this runs every call of a closed batch)
    for alive in range(len(left), 0, -1):  # left[alive - 1]: when the alive-th longest row ends
        if left[alive - 1] > done:
            b = bucket(alive, BATCH_BUCKETS)
            if b not in costs:
                costs[b] = cost_at(b)
            total += (left[alive - 1] - done) * costs[b]
            done = left[alive - 1]
    return total


def row_factors(reqs) -> np.ndarray:
    """Each request's drafts accepted over those the policy expected of its verified steps."""
    seen = np.array([r.drafts for r in reqs], dtype=float).reshape(-1, 2)
    return (seen[:, 0] + ROW_PRIOR_DRAFTS) / (seen[:, 1] + ROW_PRIOR_DRAFTS)


def plain_finishes_first(policy, rows: int, tree, reqs) -> bool:
    """Whether the closed batch `reqs` (bucket `rows`) ends sooner decoding plainly than verifying `tree`."""
    expected, here_tree, here_plain = policy.expected(tree), policy.cost(rows, tree.label), policy.cost(rows, PLAIN)
    if expected is None or here_tree is None or here_plain is None:
        return False
    left = np.array([max(r.params.max_tokens - len(r.output_ids), 1) for r in reqs], dtype=float)
    rate = 1.0 + row_factors(reqs) * (expected - 1.0)
    t_tree = wave_ms(left / rate, lambda b: policy.cost(b, tree.label) or here_tree)
    t_plain = wave_ms(left, lambda b: policy.cost(b, PLAIN) or here_plain)
    last, switch = policy.run[0], policy.launch_ms.get(rows, 0.0)  # a change does not chain: it pays a launch
    if last == PLAIN:
        t_tree += switch + here_tree  # (and the tree's first step verifies the roots alone)
    elif last is not None:
        t_plain += switch
    return t_plain < t_tree
