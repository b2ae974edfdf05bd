"""Free pages a chained request takes past its need (scheduler/dispatch.py SLACK_PAGES) against
none, alternating in one process on the same programs: end-to-end tokens/s, host ms a call (wall
time not spent waiting on the device, over calls) and how many chained calls put a new page table
on the device (with command buffers such a call's launch updates the recorded graph:
fresh_inputs-*.json). SmolLM2-shaped target and EAGLE-3 head, random bf16 weights (the head
drafts badly: about one token a step), prompts of 64 tokens, ignore_eos.

    python bench/probes/page_slack.py [--batches 1,8] [--max-tokens 256] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp
import numpy as np
from flax import nnx

from common import print_table, write_results
from host_probe import SMOL
from jaxspec import Generator, SamplingParams
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.models import Llama
from jaxspec.scheduler import dispatch


def counted_pass(gen, prompts, params):
    sched = gen.scheduler
    seen = {"chained": 0, "new_table": 0}
    chain = type(sched)._chain

    def counting(self, f):
        seen["chained"] += 1
        seen["new_table"] += [len(r.pages) for r in f.reqs] != f.inputs["pages"]
        return chain(self, f)
    type(sched)._chain = counting
    st0 = dict(sched.stats)
    t0 = time.perf_counter()
    try:
        outs = gen.generate(prompts, params)
    finally:
        type(sched)._chain = chain
    wall = time.perf_counter() - t0
    calls = sched.stats["steps"] - st0["steps"]
    wait = sched.stats["wait_time"] - st0["wait_time"]
    return dict(tokens_per_s=sum(len(o.token_ids) for o in outs) / wall, calls=calls,
                host_ms_per_call=1e3 * (wall - wait) / calls, wait_ms_per_call=1e3 * wait / calls, **seen)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = Llama(SMOL, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    head = DraftHead(HeadConfig.for_target(SMOL, "eagle3"), dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    kw = dict(max_batch=8, max_seq_len=1024, warmup=True)
    gens = {"plain": Generator(model, None, **kw),
            "eagle3 6:4:24": Generator(model, None, drafter=EagleDrafter(head, TreeShape(6, 4, 24)), **kw)}
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for b in map(int, args.batches.split(",")):
        prompts = [[int(t) for t in rng.integers(3, SMOL.vocab_size, 64)] for _ in range(b)]
        for algo, gen in gens.items():
            counted_pass(gen, prompts, params)  # every shape compiled
            runs = {0: [], dispatch.SLACK_PAGES: []}
            for _ in range(args.rounds):
                for slack in runs:
                    dispatch.SLACK_PAGES = slack
                    runs[slack].append(counted_pass(gen, prompts, params))
            dispatch.SLACK_PAGES = max(runs)
            for slack, rs in runs.items():
                rows.append(dict(algorithm=algo, batch=b, slack_pages=slack,
                                 **{k: float(np.median([r[k] for r in rs])) for k in rs[0]}))
                print_table(rows[-1:], ["algorithm", "batch", "slack_pages", "tokens_per_s", "host_ms_per_call",
                                        "wait_ms_per_call", "chained", "new_table"])
    print_table(rows, ["algorithm", "batch", "slack_pages", "tokens_per_s", "host_ms_per_call", "wait_ms_per_call",
                       "calls", "chained", "new_table"])
    print(write_results("page_slack", rows))


if __name__ == "__main__":
    main()
