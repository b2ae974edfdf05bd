"""Why a large batch decoded plainly by an EAGLE-3 engine ran slower than a plain engine.

At batch 64 the EAGLE-3 engine verifies nothing (its bucket gets no tree: every request decodes
plainly with the target alone), yet spec-auto-humaneval- (147c723) timed it at 0.87-0.90x the
plain engine over the same requests. Here a SmolLM2-shaped target and an EAGLE-3 head with random
bf16 weights run the same ragged batch (prompts of 64-448 tokens, 32-160 new tokens each,
ignore_eos) through a plain Generator and an EAGLE-3 one, in turn, `--rounds` times: wall time,
tokens/s and the scheduler's counters (calls, chained calls, preemptions, prefill time), so that a
difference shows where it comes from.

    python bench/probes/plain_fallback.py [--batch 64] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np

from common import print_table, smollm2_and_head, write_results
from jaxspec import Generator, SamplingParams
from jaxspec.drafters.eagle import EagleDrafter
from jaxspec.drafters.eagle_step import TreeShape

COLS = ["engine", "round", "batch", "tokens", "wall_s", "tokens_per_s", "steps", "chained_steps", "calls",
        "preemptions", "prefill_s", "decode_s", "wait_s", "num_pages"]
COUNTERS = ("steps", "chained_steps", "preemptions", "prefill_time", "decode_time", "wait_time", "verify_steps")


def run(gen, prompts, params):
    st0 = dict(gen.scheduler.stats)
    t0 = time.perf_counter()
    outs = gen.generate(prompts, params)
    wall = time.perf_counter() - t0
    d = {k: gen.scheduler.stats[k] - st0[k] for k in COUNTERS}
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, steps=d["steps"],
                chained_steps=d["chained_steps"], calls=d["steps"], preemptions=d["preemptions"],
                prefill_s=d["prefill_time"], decode_s=d["decode_time"], wait_s=d["wait_time"],
                verify_steps=d["verify_steps"], num_pages=gen.scheduler.pool.num_pages)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tree", default="6:4:24")
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None, help="fewer target layers (a CPU smoke run)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    cfg, model, head = smollm2_and_head(args.layers)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(100, cfg.vocab_size, int(n)))) for n in rng.integers(64, 448, args.batch)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True) for m in rng.integers(32, 160, args.batch)]
    kw = dict(max_batch=args.batch, max_seq_len=1024, warmup=True)
    if args.num_pages:
        kw["num_pages"] = args.num_pages
    gens = {"plain": Generator(model, None, **kw),
            f"eagle3:{args.tree}": Generator(model, None, drafter=EagleDrafter(head, TreeShape.parse(args.tree)), **kw)}
    for gen in gens.values():
        run(gen, prompts, params)  # untimed: first calls
    rows = []
    for rnd in range(args.rounds):
        for name, gen in gens.items():
            rows.append(dict(engine=name, round=rnd, batch=args.batch, **run(gen, prompts, params)))
            print_table(rows[-1:], COLS)
    print_table(rows, COLS)
    print(write_results("plain_fallback" + args.tag, rows, {"batch": args.batch}))


if __name__ == "__main__":
    main()
