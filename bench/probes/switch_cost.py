"""What a change of tree shape costs a chain of verify calls, now that it chains on the last call's
drafts through a device cut (scheduler/trees.py DraftCuts) rather than waiting for them.

An engine with spec_policy='auto' at batch 1 (SmolLM2-shaped target, EAGLE-3 head, random bf16
weights: the step's work does not depend on the values) launches its verify_steps programs back
to back as the scheduler chains them, every row live over `--context` tokens, one wait at the
end, in several patterns of shapes: each shape alone ('A' x calls), and alternations ('AB',
'AAAB', ...) where every change of shape takes the last call's drafts through the cut. A
pattern's ms a call against the mean of its shapes' own (weighted by their calls) is what each
switch adds; the launches' host time a call beside it.

    python bench/probes/switch_cost.py [--trees 3:1:4,6:4:24,6:8:64] [--calls 24] [--context 256]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import numpy as np

from common import print_table, smollm2_and_head, write_results
from jaxspec import Generator
from jaxspec.drafters.eagle import EagleDrafter
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.programs import TREE_BUCKETS, bucket
from jaxspec.sampling import SamplerFlags

COLS = ["pattern", "calls", "switches", "ms_per_call", "expected_ms_per_call", "ms_per_switch", "launch_ms_per_call"]


def run_pattern(sched, trees, pattern, calls, context):
    """ms a call and launch ms a call of `calls` chained calls cycling through `pattern` (letters
    index trees), every change of shape through the scheduler's cut."""
    flags = SamplerFlags()
    pages = np.arange(1, sched.max_pages_per_seq + 1, dtype=np.int32)[None]
    first = trees[ord(pattern[0]) - 65]
    args = list(sched._dummy_verify(1, bucket(first.num_draft_tokens, TREE_BUCKETS), sched.verify_steps, alive=True))
    args[2], args[3] = pages, np.full(1, context, np.int32)
    args = jax.device_put(tuple(args))
    state = dict(cache=sched.cache, tree=first)

    def launch(args, tree):
        if tree != state["tree"]:  # the drafts cut to the next program's nodes and depth, as _chain does
            tokens, parents, num_nodes = sched.cuts(*state["out"][5], tree, tree.num_draft_tokens)
            args = (tokens, parents, args[2], args[3], num_nodes, *args[5:8], np.int32(tree.num_draft_tokens), args[9])
        *out, state["cache"] = sched.tree_programs[tree].verify_steps(state["cache"], *jax.device_put(args), flags=flags)
        state["out"], state["tree"] = out, tree
        tokens, parents, kv, sb, budget = out[6]
        kv = kv.at[:].set(context)  # the context stays put: every call the same work
        return out, (tokens, parents, args[2], kv, args[4], budget, args[6], args[7], args[8], sb)

    seq = [trees[ord(pattern[i % len(pattern)]) - 65] for i in range(calls)]
    for tree in seq[:len(pattern)]:  # one round untimed
        out, args = launch(args, tree)
    jax.block_until_ready(out)
    host, t0 = 0.0, time.perf_counter()
    for tree in seq:
        h = time.perf_counter()
        out, args = launch(args, tree)
        host += time.perf_counter() - h
    jax.block_until_ready(out)
    wall = time.perf_counter() - t0
    sched.cache = state["cache"]
    switches = sum(a != b for a, b in zip(seq, seq[1:] + seq[:1]))
    return 1e3 * wall / calls, 1e3 * host / calls, switches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", default="3:1:4,6:4:24,6:8:64")
    ap.add_argument("--patterns", default="A,B,C,AB,AAAB,BC,BBBC,AC")
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--layers", type=int, default=None, help="fewer target layers (a CPU smoke run)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    cfg, model, head = smollm2_and_head(args.layers)
    trees = [TreeShape.parse(t) for t in args.trees.split(",")]
    gen = Generator(model, None, drafter=EagleDrafter(head, trees[0]), max_batch=1, max_seq_len=1024,
                    spec_policy="auto", spec_trees=trees, warmup=True, compile_cache="off")
    sched = gen.scheduler
    alone, rows = {}, []
    for pattern in args.patterns.split(","):
        ms, launch_ms, switches = run_pattern(sched, trees, pattern, args.calls, args.context)
        if len(set(pattern)) == 1:
            alone[pattern[0]] = ms
        expected = np.mean([alone[c] for c in pattern]) if all(c in alone for c in pattern) else None
        rows.append(dict(pattern=pattern, shapes=[trees[ord(c) - 65].label for c in pattern], calls=args.calls,
                         switches=switches, ms_per_call=ms, expected_ms_per_call=expected,
                         ms_per_switch=None if expected is None or not switches else
                         (ms - expected) * args.calls / switches, launch_ms_per_call=launch_ms))
        print_table(rows[-1:], COLS)
    assert sched.late_compiles == [], sched.late_compiles
    print_table(rows, COLS)
    write_results(f"switch_cost{args.tag}", rows, {"context": args.context, "trees": args.trees,
                                                   "verify_steps": sched.verify_steps})


if __name__ == "__main__":
    main()
