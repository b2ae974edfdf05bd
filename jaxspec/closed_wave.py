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
the tree and plain decoding pays the bucket's launch cost (and a move to the tree a step that verifies
the roots alone): such a change once never chained on the last call, and now chains only while the
batch is steady; the charge keeps near-tied estimates from flipping the batch call after call
(replayed with those costs, the DFLASH chain's MT-bench wave ran 0.972x plain with them and 0.957x
without: wave_tail-policies-).

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


def closed(reqs) -> bool:
    """Whether decoding requests form a closed batch: several, all of one generate call."""
    return len(reqs) > 1 and reqs[0].group is not None and all(r.group is reqs[0].group for r in reqs)


def plain_ends_first(left, factors, expected: float, tree_ms, plain_ms, last: str | None = None,
                     switch: float = 0.0) -> bool:
    """Whether rows with `left` tokens to go end sooner decoding plainly than verifying a tree that
    emits 1 + factor x (expected - 1) tokens a step for each; tree_ms / plain_ms: bucket -> ms a
    step. last ('plain', 'tree' or None): what the batch ran last; a change pays `switch` ms (and a
    move to the tree a step that verifies the roots alone)."""
    left = np.asarray(left, dtype=float)
    t_tree = wave_ms(left / (1.0 + np.asarray(factors) * (expected - 1.0)), tree_ms)
    t_plain = wave_ms(left, plain_ms)
    if last == "plain":
        t_tree += switch + tree_ms(bucket(len(left), BATCH_BUCKETS))
    elif last == "tree":
        t_plain += switch
    return t_plain < t_tree


def plain_finishes_first(policy, rows: int, tree, reqs) -> bool:
    """Whether the closed batch `reqs` (bucket `rows`) ends sooner decoding plainly than verifying `tree`."""
    expected, here_tree, here_plain = policy.expected(tree), policy.cost(rows, tree.label), policy.cost(rows, PLAIN)
    if expected is None or here_tree is None or here_plain is None:
        return False
    last = policy.run[0]  # a change is charged a launch (see above)
    return plain_ends_first([max(r.params.max_tokens - len(r.output_ids), 1) for r in reqs], row_factors(reqs), expected,
                            lambda b: policy.cost(b, tree.label) or here_tree, lambda b: policy.cost(b, PLAIN) or here_plain,
                            None if last is None else "plain" if last == PLAIN else "tree", policy.launch_ms.get(rows, 0.0))


def shrink_pays(policy, rows: int, small: int, label: str, steps_left: float) -> bool:
    """Whether a batch shrunk below its bucket `rows` moves to bucket `small`'s programs: the step cost
    they save over the steps left against the launch of the call that moves (it cannot chain on the
    last call's outputs). At the wave's tail the buckets' step costs differ little and each move paid a
    launch (3:1:4 at 1 / 4 / 8 / 16: 1.44 / 1.27 / 1.34 / 1.41 ms a step, ~5 ms a launch not chained:
    spec-why-b64-). Costs not known: it moves."""
    big, little = policy.cost(rows, label), policy.cost(small, label)
    launch = policy.launch_ms.get(small, policy.launch_ms.get(rows))
    if big is None or little is None or launch is None:
        return True
    return steps_left * (big - little) > launch
