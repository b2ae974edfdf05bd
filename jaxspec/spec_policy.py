"""Speculation sized by measured costs: the draft tree a device drafter's batch verifies, chosen
every call among the shapes whose programs were built at start-up.

At warm-up the engine times every decode and verify program of its set (StepCosts: ms a step by
kind, batch bucket and tree) and keeps the table beside its programs in the program store: a later
start of the same engine on the same device reads it back rather than timing again. While serving,
TreeChoice keeps for each tree shape the tokens rows emitted over the row-steps they took (sums
halved past KEPT_ROW_STEPS, so that they follow the requests), pooled over batch sizes (what a
tree accepts depends on the drafter and the text, not on the batch), and a histogram of them. A
tree that contains another's shape (as deep, as wide, as many nodes) is expected to accept at
least what that one did: on few calls, an unlucky first average would keep a good shape from
being chosen again. A call at bucket `rows` verifies the shape with the most
tokens per ms,

    expected(tree) / cost(rows, tree),

where a cost is the wall time a step of that shape was seen to take at that bucket (the intervals
between the outputs of calls and of the calls chained on them, summed over their steps: the
host's share counts, and a call read late lengthens its interval by what it shortens the next
one's), weighed against PRIOR_STEPS steps of the warm-up table's cost, itself scaled by how all
the costs seen compare with the table's (the table runs steady calls with nothing else to do).
Averages of single intervals varied by 5x on the H100 (spec-auto-*.json at 9a8f8c4, git
history). Every shape a bucket has runs EXPLORE_CALLS calls before any is preferred (at 9ecd17e,
after one each, HumanEval's 3:1:4 was held at an accept length of 1.25), and every probe_every
calls another runs PROBE_CALLS calls (the contenders in turn) so that the averages follow the
requests and the costs. A bucket keeps its shape unless another looks SWITCH_GAIN faster: at
batch 1 the leading shapes were within 10% of each other, about the estimates' noise, and calls
that moved between them ran at 0.88x the best fixed tree (spec-auto-*.json at 1853a27).

Plain decoding is not among the choices: the target alone leaves an EAGLE head's cache behind, so
a request decoded plainly once decodes plainly to its end, and a policy that chose plain decoding
from a few noisy calls never saw the trees again (on the H100 such a policy held HumanEval at
batch 1 at 0.99x plain, and mixed calls of behind and current heads ran MT-bench at batch 64 at
0.40x: spec-auto-*.json at 931c778, git history). Which buckets verify at all is the fixed rule's
(scheduler/trees.py).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import time

import jax

EXPLORE_CALLS = 4  # calls each shape runs before any is preferred (one call's accept length is noise)
PROBE_CALLS = 3  # calls a probe of another shape runs
PRIOR_STEPS = 16  # steps of the table's (scaled) cost a shape's seen cost is weighed against
KEPT_STEPS = 512  # a (bucket, shape)'s seen steps beyond which its sums are halved (the costs move)
KEPT_ROW_STEPS = 2048  # a shape's row-steps beyond which its accept sums are halved (the requests move)
SWITCH_GAIN = 1.05  # how much faster another shape must look for a bucket to move to it


@dataclasses.dataclass
class StepCosts:
    """ms a step of each program: ('decode', rows, None) and ('verify', rows, tree label)."""
    ms: dict = dataclasses.field(default_factory=dict)

    def save(self, path: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump([[kind, rows, tree, ms] for (kind, rows, tree), ms in sorted(self.ms.items(), key=str)], f)
        os.replace(tmp, path)  # whole or not at all: another process may be reading it

    @classmethod
    def load(cls, path: str) -> "StepCosts | None":
        """The table saved at path, or None where there is none or it is unreadable."""
        try:
            with open(path) as f:
                return cls({(kind, int(rows), tree): float(ms) for kind, rows, tree, ms in json.load(f)})
        except (OSError, ValueError, TypeError):
            return None

    def table(self) -> str:
        """ms a step: a row per batch bucket, plain decoding then each tree's verify step."""
        rows = sorted({r for _, r, _ in self.ms})
        trees = sorted({t for k, _, t in self.ms if k == "verify"}, key=lambda t: [int(x) for x in t.split(":")])
        lines = ["rows  " + "  ".join(f"{c:>9s}" for c in ["decode"] + trees)]
        for r in rows:
            cells = [self.ms.get(("decode", r, None))] + [self.ms.get(("verify", r, t)) for t in trees]
            lines.append(f"{r:4d}  " + "  ".join(" " * 9 if c is None else f"{c:9.3f}" for c in cells))
        return "\n".join(lines)


def time_call(call, reps: int = 3) -> float:
    """Median ms of call() (its outputs waited for), after one untimed call."""
    jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


class TreeChoice:
    def __init__(self, costs: StepCosts, trees_at: dict, probe_every: int = 32):
        """trees_at: batch bucket -> the tree shapes built for it (TreeShape, with .label)."""
        self.costs, self.trees_at = costs, trees_at
        self.probe_every = probe_every
        self.emitted: dict = {}  # tree -> average tokens a live row emits per verify step
        self.totals: dict = {}  # tree -> [tokens, row-steps] the average is of
        self.seen: collections.Counter = collections.Counter()  # tree -> verify calls averaged
        self.accepts: dict = collections.defaultdict(collections.Counter)  # tree -> {tokens a row-step: times}
        self.calls: collections.Counter = collections.Counter()  # bucket -> decisions taken
        self.chosen: collections.Counter = collections.Counter()  # (bucket, tree label) -> decisions
        self.observed: dict = {}  # (bucket, tree label) -> [ms, steps] seen on chained calls
        self.held: dict = {}  # bucket -> the tree its calls verify between probes

    def expected(self, tree) -> float | None:
        """Tokens a row is expected to emit per verify step of `tree`: the most that it or any shape
        it contains averaged, or None before it was seen."""
        if tree not in self.emitted:
            return None
        return max(e for t, e in self.emitted.items() if t.steps <= tree.steps and t.topk <= tree.topk
                   and t.num_draft_tokens <= tree.num_draft_tokens)

    def rate(self, rows: int, tree) -> float | None:
        """Tokens a row emits per ms of a verify step of `tree` at this bucket (per verify step where
        no cost is known), or None before the shape was seen."""
        e = self.expected(tree)
        if e is None:
            return None
        ms = self.cost(rows, tree.label)
        return e / ms if ms else e

    def cost(self, rows: int, label: str) -> float | None:
        """ms a step of a tree at this bucket: what was seen, weighed against PRIOR_STEPS steps of
        the table's cost scaled by seen over table time of every shape seen; None where neither."""
        seen = self.observed.get((rows, label))
        table = self.costs.ms.get(("verify", rows, label))
        if table is None:
            return seen[0] / seen[1] if seen else None
        pairs = [(ms, steps * t) for (r, k), (ms, steps) in self.observed.items()
                 if (t := self.costs.ms.get(("verify", r, k)))]
        prior = table * (sum(ms for ms, _ in pairs) / sum(t for _, t in pairs) if pairs else 1.0)
        ms, steps = seen or (0.0, 0)
        return (ms + PRIOR_STEPS * prior) / (steps + PRIOR_STEPS)

    def timed(self, rows: int, label: str, ms: float, steps: int) -> None:
        """Calls of a tree at this bucket took `ms` over `steps` steps."""
        seen = self.observed.setdefault((rows, label), [0.0, 0])
        seen[0] += ms
        seen[1] += steps
        if seen[1] > KEPT_STEPS:
            seen[0], seen[1] = seen[0] / 2, seen[1] / 2

    def choose(self, rows: int):
        """The tree a call at this bucket verifies (None where the bucket has none)."""
        trees = self.trees_at.get(rows, ())
        if not trees:
            return None
        pick = next((t for t in trees if self.seen[t] < EXPLORE_CALLS), None)  # learn what each accepts
        if pick is None:
            n = self.calls[rows] = self.calls[rows] + 1
            ranked = sorted(trees, key=lambda t: self.rate(rows, t), reverse=True)
            pick = ranked[0]
            held = self.held.get(rows)
            if held in trees and self.rate(rows, pick) < SWITCH_GAIN * self.rate(rows, held):
                pick = held  # within the estimates' noise: a change of shape costs an unchained call
            self.held[rows] = pick
            if n % self.probe_every < PROBE_CALLS and n >= self.probe_every and len(ranked) > 1:
                # the shapes within 25% of the best in turn (at least the runner-up): they could
                # overtake it. PROBE_CALLS calls in a row: the costs are seen on chained calls only
                rivals = [t for t in ranked[1:] if self.rate(rows, t) >= 0.75 * self.rate(rows, pick)] or ranked[1:2]
                pick = rivals[(n // self.probe_every) % len(rivals)]
        self.chosen[(rows, pick.label)] += 1
        return pick

    def verified(self, tree, emitted: list[int]) -> None:
        """A verify call of `tree`: the tokens each live row emitted at each of its steps."""
        if not emitted:
            return
        self.accepts[tree].update(emitted)
        self.seen[tree] += 1
        total = self.totals.setdefault(tree, [0, 0])  # tokens, row-steps: halved past KEPT_ROW_STEPS
        total[0] += sum(emitted)
        total[1] += len(emitted)
        if total[1] > KEPT_ROW_STEPS:
            total[0], total[1] = total[0] / 2, total[1] / 2
        self.emitted[tree] = total[0] / total[1]

    def summary(self) -> dict:
        """What the policy learned and did: per tree its accept length and the histogram of tokens
        a row-step emitted, per bucket the costs seen and how many calls took each tree."""
        by_bucket = lambda d: {str(r): {k: v for (r2, k), v in sorted(d.items()) if r2 == r}
                               for r in sorted({r for r, _ in d})}
        return dict(accept_length={t.label: round(e, 3) for t, e in self.emitted.items()},
                    accept_histogram={t.label: dict(sorted(c.items())) for t, c in self.accepts.items()},
                    observed_ms=by_bucket({k: round(ms / steps, 3) for k, (ms, steps) in self.observed.items()}),
                    chosen=by_bucket(self.chosen))
