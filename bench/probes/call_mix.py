"""How a closed loop of `c` requests (a server's concurrency sweep) splits into program calls: every
finished request is replaced by a new one before the next step, as the load's clients replace
theirs. A decode call runs decode_steps (8) steps only while the batch is steady, so each arrival
or prefill chunk cuts the calls to one step, and each call costs the host its launch (about a
millisecond on the H100: host_probe-*.json). Counts only, independent of the device: a tiny random
target (SmolLM2's vocabulary is not needed), prompts of 50-150 tokens, 150-256 new tokens each.
Rows: concurrency, decode calls (verify calls among them), rows x steps a decode call, the share
of those from one-step calls, prefill calls per finished request. With --algos plain,eagle3 the same loads run on an
engine with a (random) EAGLE-3 head and the server's default tree, 6:4:24, as bench/serve.py
starts them (max batch the largest concurrency): where its batches decode plainly, its calls
should be plain's.

    python bench/probes/call_mix.py [--concurrency 8,32,128] [--requests 512] [--algos plain,eagle3]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
from flax import nnx

from common import print_table, write_results
from jaxspec import Generator, SamplingParams
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.models import Llama, ModelConfig

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position=512, eos_token_ids=(63,))


def closed_loop(gen, concurrency, requests, seed=0):
    s = gen.scheduler
    rng = np.random.default_rng(seed)
    calls = collections.Counter()  # steps a decode (or verify) call -> calls
    tokens = collections.Counter()  # steps a call -> rows x steps it ran
    chained, verifies = [0], [0]
    orig_collect = s._collect

    def collect(f, chunk=None):  # every call is read back once, chained or not
        if f.kind in ("decode", "verify"):
            verifies[0] += f.kind == "verify"
            calls[f.steps] += 1
            tokens[f.steps] += len(f.reqs) * f.steps
            chained[0] += f.chained
        elif f.kind == "extend":
            prefills[0] += 1
        return orig_collect(f, chunk)
    prefills = [0]
    s._collect = collect

    def new():
        prompt = list(map(int, rng.integers(0, 62, int(rng.integers(50, 150)))))
        return s.add(prompt, SamplingParams(max_tokens=int(rng.integers(150, 257)), ignore_eos=True))

    live = [new() for _ in range(concurrency)]
    started, done = concurrency, 0
    while live:
        s.step()
        for r in [r for r in live if r.finished]:
            live.remove(r)
            done += 1
            if started < requests:
                live.append(new())
                started += 1
    s._collect = orig_collect
    total_calls, total_tokens = sum(calls.values()), sum(tokens.values())
    st = s.stats
    return dict(concurrency=concurrency, requests=done, decode_calls=total_calls,
                verify_calls=verifies[0], behind_plain_steps=st["behind_plain_steps"],
                tokens_per_decode_call=total_tokens / total_calls, one_step_call_share=calls[1] / total_calls,
                one_step_token_share=tokens[1] / total_tokens, chained_share=chained[0] / total_calls,
                prefill_calls_per_request=prefills[0] / done,
                calls_by_steps=dict(sorted(calls.items())))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="8,32,128")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--algos", default="plain")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    model = Llama(TINY, rngs=nnx.Rngs(0))
    rows = []
    for algo in args.algos.split(","):
        drafter = None
        if algo == "eagle3":
            head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1))
            drafter = EagleDrafter(head, TreeShape(6, 4, 24))
        # a fresh engine per load, as a fresh server
        for c in levels:
            gen = Generator(model, None, drafter=drafter, max_batch=max(levels), max_seq_len=512,
                            num_pages=1 + max(levels) * 512 // 16, warmup=False)
            rows.append(dict(algorithm=algo, **closed_loop(gen, c, max(args.requests, 2 * c))))
    cols = ["algorithm", "concurrency", "requests", "decode_calls", "verify_calls", "behind_plain_steps",
            "tokens_per_decode_call", "one_step_call_share", "chained_share", "prefill_calls_per_request"]
    print_table(rows, cols)
    print(write_results("call_mix" + args.tag, rows, {"decode_steps": gen.scheduler.decode_steps}))


if __name__ == "__main__":
    main()
